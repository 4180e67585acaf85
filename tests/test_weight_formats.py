"""Weight formats beyond one safetensors file (issue 28 item 3): PyTorch .bin / .pt checkpoints read with
`torch.load(weights_only=True, mmap=True)`, a pickle carrying anything but tensors refused, the per-rank
sharded state (`pagedllm save-sharded-state`, the `sharded_state` loader) at tp 1 and 2, and a Hugging Face
repo id resolved from the local HF cache, offline.

Reference: transformers' greedy tokens on the same weights (tiny_models.hf_greedy) and the safetensors
folder's tokens through our engine."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import hf_greedy, make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.cli.main import main
from pagedllm.testing import check_loader

PROMPTS = [[1, 5, 9, 33, 70, 11, 250, 17, 3], [1, 100, 200, 300], [1, 42, 42, 42, 42, 42, 7, 8, 9, 10]]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE: dict[str, Any] = dict(device="cpu", block_size=4, kv_cache_memory_gb=0.01)


def _tokens(model: str, **kwargs: Any) -> tuple[list[list[int]], str]:
    with LLM(model, **ENGINE, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        loader = llm.engine.parts.selections["loader"].winner.name
    return [list(o.outputs[0].token_ids) for o in outs], loader


@pytest.fixture(scope="module")
def safetensors_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("formats"))


@pytest.fixture(scope="module")
def expected(safetensors_model: str) -> list[list[int]]:
    return [tokens for tokens, _ in hf_greedy(safetensors_model, PROMPTS, MAX_TOKENS)]


def _copy_without_weights(src: str, dst: Path) -> Path:
    dst.mkdir()
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and not name.endswith(".index.json"):
            shutil.copy2(os.path.join(src, name), dst / name)
    return dst


@pytest.mark.parametrize("suffix", [".bin", ".pt"])
def test_pytorch_checkpoint_equals_safetensors(suffix: str, safetensors_model: str, expected: list[list[int]],
                                               tmp_path: Path) -> None:
    state = load_file(os.path.join(safetensors_model, "model.safetensors"))
    folder = _copy_without_weights(safetensors_model, tmp_path / "pt")
    names = sorted(state)
    half = len(names) // 2
    # Two shards and an index, as transformers writes large .bin checkpoints.
    files = {f"pytorch_model-0000{i + 1}-of-00002{suffix}": part for i, part in enumerate((names[:half], names[half:]))}
    for fname, part in files.items():
        torch.save({n: state[n] for n in part}, folder / fname)
    weight_map = {n: fname for fname, part in files.items() for n in part}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tokens, loader = _tokens(str(folder))
    assert loader == "hf" and tokens == expected


def test_wrapped_state_dict_and_single_file(safetensors_model: str, expected: list[list[int]], tmp_path: Path) -> None:
    state = load_file(os.path.join(safetensors_model, "model.safetensors"))
    folder = _copy_without_weights(safetensors_model, tmp_path / "wrapped")
    torch.save({"state_dict": state}, folder / "model.pt")  # a training script's wrapper
    torch.save({"epoch": 3}, folder / "training_args.bin")  # beside many fine-tunes; holds no weights
    assert _tokens(str(folder))[0] == expected


class _Payload:
    """What a malicious checkpoint would carry: unpickling it would call os.system."""

    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned > /tmp/pagedllm-pickle-ran",))


def test_pickle_with_code_is_refused(safetensors_model: str, tmp_path: Path) -> None:
    state: dict[str, Any] = dict(load_file(os.path.join(safetensors_model, "model.safetensors")))
    state["extra"] = _Payload()
    folder = _copy_without_weights(safetensors_model, tmp_path / "evil")
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump(state, f, protocol=2)  # the legacy (non-zip) format: torch.load's weights-only unpickler reads it too
    marker = Path("/tmp/pagedllm-pickle-ran")
    marker.unlink(missing_ok=True)
    with pytest.raises(Exception, match=r"refused: the checkpoint holds objects other than tensors") as info:
        _tokens(str(folder))
    assert "pytorch_model.bin" in str(info.value)
    assert not marker.exists(), "the pickle's payload ran"


def test_non_tensor_entry_is_refused(safetensors_model: str, tmp_path: Path) -> None:
    state: dict[str, Any] = dict(load_file(os.path.join(safetensors_model, "model.safetensors")))
    state["model.norm.step"] = 7  # allowed by weights_only, but not a weight
    folder = _copy_without_weights(safetensors_model, tmp_path / "int")
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(Exception, match=r"entry 'model.norm.step' is int, not a tensor"):
        _tokens(str(folder))


def test_sharded_state_tp1(safetensors_model: str, expected: list[list[int]], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sharded1"
    assert main(["save-sharded-state", safetensors_model, str(out), "--max-file-size", "60000"]) == 0
    assert "for 1 rank(s)" in capsys.readouterr().out
    parts = sorted(p.name for p in out.glob("model-rank-0-part-*.safetensors"))
    assert len(parts) > 1  # split by --max-file-size
    tokens, loader = _tokens(str(out))
    assert loader == "sharded_state" and tokens == expected
    # The conformance kit's loader check: every parameter as the safetensors file puts it, bit for bit.
    reference = load_file(os.path.join(safetensors_model, "model.safetensors"))
    assert check_loader("sharded_state", str(out), reference).tensors_compared > 10


@pytest.mark.slow  # starts a rank-1 process
def test_sharded_state_tp2(safetensors_model: str, expected: list[list[int]], tmp_path: Path) -> None:
    out = tmp_path / "sharded2"
    assert main(["save-sharded-state", safetensors_model, str(out), "-tp", "2"]) == 0
    rank0 = load_file(str(out / "model-rank-0-part-0.safetensors"))
    rank1 = load_file(str(out / "model-rank-1-part-0.safetensors"))
    o = "model.layers.0.self_attn.o_proj.weight"
    full = load_file(os.path.join(safetensors_model, "model.safetensors"))[o]
    assert torch.equal(torch.cat([rank0[o], rank1[o]], dim=1), full)  # each rank holds its own columns
    tokens, loader = _tokens(str(out), tensor_parallel_size=2)
    assert loader == "sharded_state" and tokens == expected
    with pytest.raises(Exception, match="was saved for tensor_parallel_size 2, the engine runs 1"):
        _tokens(str(out))


def test_save_sharded_state_refuses_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_gguf_loader import tiny_hf_weights, write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_weights("llama"))
    assert main(["save-sharded-state", str(path), str(tmp_path / "out")]) == 2
    assert "pagedllm save-sharded-state: error: '" in (err := capsys.readouterr().err) and "is a quantized checkpoint (gguf)" in err


def test_hub_repo_id_from_the_local_cache(safetensors_model: str, expected: list[list[int]], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / ("a" * 40)
    shutil.copytree(safetensors_model, snapshot)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    tokens, loader = _tokens("tiny-org/tiny-llama")
    assert loader == "hf" and tokens == expected
    with pytest.raises(FileNotFoundError, match=r"'tiny-org/absent' is neither a local path nor in the local "
                                                r"Hugging Face cache"):
        _tokens("tiny-org/absent")
