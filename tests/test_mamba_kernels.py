"""Mamba kernels in torch against references we did not write: transformers' pure-torch slow paths
(MambaMixer's selective scan and conv1d, Mamba2Mixer's chunk scan) and a plain token-by-token recurrence.

Every kernel is checked over varlen batches (several requests back to back, state slots shuffled) and in
pieces (a prompt split into chunks, each starting from the state the previous one stored), which is how the
engine's chunked prefill and decode drive them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.plugins.models.mamba.conv1d import causal_conv1d_update, causal_conv1d_varlen
from pagedllm.plugins.models.mamba.selective_scan import selective_scan_varlen, selective_state_update
from pagedllm.plugins.models.mamba.ssd import ssd_chunk_scan_varlen

LENS = [7, 1, 13, 3]  # one request shorter than the conv window, one of a single token
SLOTS = [5, 2, 7, 0]


def _qsl(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _pieces(length: int) -> list[tuple[int, int]]:
    """Split [0, length) into uneven chunks: 2, 1, 5, then the rest."""
    bounds, pos = [], 0
    for size in (2, 1, 5, length):
        if pos >= length:
            break
        bounds.append((pos, min(length, pos + size)))
        pos = bounds[-1][1]
    return bounds


# --- conv1d ---------------------------------------------------------------------------------------------


def test_conv1d_varlen_matches_transformers_and_chunks() -> None:
    from transformers.models.mamba.modeling_mamba import causal_conv1d_fn

    torch.manual_seed(0)
    dim, k = 6, 4
    w, b = torch.randn(dim, k), torch.randn(dim)
    x = torch.randn(sum(LENS), dim)
    qsl = _qsl(LENS)
    states = torch.randn(8, dim, k - 1)  # leftovers: a fresh request must not read them
    out = causal_conv1d_varlen(x, w, b, states, qsl, SLOTS, [False] * 4)
    for i, slot in enumerate(SLOTS):
        seq = x[qsl[i] : qsl[i + 1]]
        ref = causal_conv1d_fn(seq.t()[None], w, b, activation="silu")[0].t()
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], ref)
        # The state is the last K - 1 inputs, zero-padded on the left for short requests.
        padded = torch.cat([torch.zeros(k - 1, dim), seq])
        torch.testing.assert_close(states[slot], padded[-(k - 1) :].t())

    # The longest request in pieces, each starting from the stored state, then token by token (decode).
    seq = x[qsl[2] : qsl[3]]
    pieces = torch.zeros(1, dim, k - 1)
    got = [
        causal_conv1d_varlen(seq[s:e], w, b, pieces, [0, e - s], [0], [s > 0])
        for s, e in _pieces(len(seq) - 3)
    ]
    slot = torch.tensor([0])
    for t in range(len(seq) - 3, len(seq)):
        got.append(causal_conv1d_update(seq[t : t + 1], pieces, w, b, slot, torch.tensor([True])))
    torch.testing.assert_close(torch.cat(got), out[qsl[2] : qsl[3]])
    torch.testing.assert_close(pieces[0], states[SLOTS[2]])


def test_conv1d_update_fresh_state_reads_zeros() -> None:
    torch.manual_seed(1)
    dim, k = 5, 4
    w, b = torch.randn(dim, k), torch.randn(dim)
    x = torch.randn(2, dim)
    states = torch.randn(3, dim, k - 1)
    out = causal_conv1d_update(x, states.clone(), w, b, torch.tensor([2, 0]), torch.tensor([False, True]))
    ref = causal_conv1d_varlen(x, w, b, states.clone(), [0, 1, 2], [2, 0], [False, True])
    torch.testing.assert_close(out, ref)


# --- Mamba-1 selective scan -------------------------------------------------------------------------------


def _scan_inputs(total: int, dim: int = 6, n: int = 4) -> dict[str, torch.Tensor]:
    return {
        "u": torch.randn(total, dim),
        "delta": torch.randn(total, dim),
        "A": -torch.rand(dim, n) - 0.1,
        "B": torch.randn(total, n),
        "C": torch.randn(total, n),
        "D": torch.randn(dim),
        "z": torch.randn(total, dim),
        "delta_bias": torch.randn(dim),
    }


def test_selective_scan_matches_transformers_slow_path() -> None:
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    torch.manual_seed(2)
    a = _scan_inputs(sum(LENS))
    qsl = _qsl(LENS)
    states = torch.randn(8, 6, 4)
    y = selective_scan_varlen(
        a["u"], a["delta"], a["A"], a["B"], a["C"], states, qsl, SLOTS, [False] * 4,
        D=a["D"], z=a["z"], delta_bias=a["delta_bias"], delta_softplus=True,
    )
    for i, slot in enumerate(SLOTS):
        r = slice(qsl[i], qsl[i + 1])
        ref, last = mamba_selective_scan(
            a["u"][r].t()[None], a["delta"][r].t()[None], a["A"], a["B"][r].t()[None], a["C"][r].t()[None],
            D=a["D"], z=a["z"][r].t()[None], delta_bias=a["delta_bias"], delta_softplus=True,
            return_last_state=True,
        )
        torch.testing.assert_close(y[r], ref[0].t())
        torch.testing.assert_close(states[slot], last[0])


def test_selective_scan_chunks_and_decode_continue_the_state() -> None:
    torch.manual_seed(3)
    length = 12
    a = _scan_inputs(length)
    whole_state = torch.zeros(1, 6, 4)
    kw = {"D": a["D"], "delta_bias": a["delta_bias"], "delta_softplus": True}
    whole = selective_scan_varlen(
        a["u"], a["delta"], a["A"], a["B"], a["C"], whole_state, [0, length], [0], [False], z=a["z"], **kw
    )
    state = torch.zeros(1, 6, 4)
    got = []
    for s, e in _pieces(length - 2):
        got.append(selective_scan_varlen(
            a["u"][s:e], a["delta"][s:e], a["A"], a["B"][s:e], a["C"][s:e], state, [0, e - s], [0], [s > 0],
            z=a["z"][s:e], **kw,
        ))
    # Decode in the heads form (H = 1 head of P = 6 channels, G = 1), as the Mamba-1 layer calls it.
    heads_state = state.view(1, 1, 6, 4)
    for t in range(length - 2, length):
        got.append(selective_state_update(
            heads_state, a["u"][t].view(1, 1, 6), a["delta"][t].view(1, 1, 6), a["A"][None],
            a["B"][t].view(1, 1, 4), a["C"][t].view(1, 1, 4), torch.tensor([0]),
            D=a["D"][None], z=a["z"][t].view(1, 1, 6), dt_bias=a["delta_bias"][None], dt_softplus=True,
        ).view(1, 6))
    torch.testing.assert_close(torch.cat(got), whole)
    torch.testing.assert_close(state, whole_state)


# --- Mamba-2 SSD ------------------------------------------------------------------------------------------


def _naive_ssd(x, dt, A, B, C, D, h):  # type: ignore[no-untyped-def]
    """The recurrence written out token by token: [L, H, P] inputs, h [H, P, N]."""
    heads, groups = x.shape[1], B.shape[1]
    ys = []
    for t in range(x.shape[0]):
        Bt = B[t].repeat_interleave(heads // groups, 0)  # [H, N]
        Ct = C[t].repeat_interleave(heads // groups, 0)
        h = torch.exp(dt[t] * A)[:, None, None] * h + dt[t][:, None, None] * x[t][:, :, None] * Bt[:, None, :]
        ys.append((h * Ct[:, None, :]).sum(-1) + D[:, None] * x[t])
    return torch.stack(ys), h


def _ssd_inputs(total: int, heads: int = 4, p: int = 3, g: int = 2, n: int = 5) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(total, heads, p),
        "dt": torch.randn(total, heads),
        "A": -torch.rand(heads) - 0.2,
        "B": torch.randn(total, g, n),
        "C": torch.randn(total, g, n),
        "D": torch.randn(heads),
        "dt_bias": torch.randn(heads),
    }


def test_ssd_matches_naive_recurrence_varlen() -> None:
    torch.manual_seed(4)
    a = _ssd_inputs(sum(LENS))
    qsl = _qsl(LENS)
    init = torch.randn(8, 4, 3, 5)
    states = init.clone()
    has_init = [True, False, True, False]
    y = ssd_chunk_scan_varlen(
        a["x"], a["dt"], a["A"], a["B"], a["C"], states, qsl, SLOTS, has_init, chunk_size=4,
        D=a["D"], dt_bias=a["dt_bias"], dt_softplus=True,
    )
    dt = F.softplus(a["dt"] + a["dt_bias"])
    for i, slot in enumerate(SLOTS):
        r = slice(qsl[i], qsl[i + 1])
        h0 = init[slot] if has_init[i] else torch.zeros(4, 3, 5)
        ref, last = _naive_ssd(a["x"][r], dt[r], a["A"], a["B"][r], a["C"][r], a["D"], h0)
        torch.testing.assert_close(y[r], ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states[slot], last, rtol=1e-4, atol=1e-4)


def test_ssd_matches_transformers_chunk_scan_with_initial_state() -> None:
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    torch.manual_seed(5)
    length = 21
    a = _ssd_inputs(length)
    init = torch.randn(1, 4, 3, 5)
    states = init.clone()
    y = ssd_chunk_scan_varlen(
        a["x"], a["dt"], a["A"], a["B"], a["C"], states, [0, length], [0], [True], chunk_size=8,
        D=a["D"], dt_bias=a["dt_bias"], dt_softplus=True,
    )
    ref, last = mamba2_chunk_scan(
        a["x"][None], a["dt"][None], a["A"], a["B"][None], a["C"][None], chunk_size=8, D=a["D"],
        dt_bias=a["dt_bias"], initial_states=init, dt_softplus=True, return_final_states=True,
    )
    torch.testing.assert_close(y, ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, last, rtol=1e-4, atol=1e-4)


def test_ssd_chunks_and_decode_continue_the_state() -> None:
    torch.manual_seed(6)
    length, heads, p, n = 14, 4, 3, 5
    a = _ssd_inputs(length)
    kw = {"D": a["D"], "dt_bias": a["dt_bias"], "dt_softplus": True}
    whole_state = torch.zeros(1, heads, p, n)
    whole = ssd_chunk_scan_varlen(
        a["x"], a["dt"], a["A"], a["B"], a["C"], whole_state, [0, length], [0], [False], chunk_size=4, **kw
    )
    state = torch.zeros(1, heads, p, n)
    got = []
    for s, e in _pieces(length - 2):
        got.append(ssd_chunk_scan_varlen(
            a["x"][s:e], a["dt"][s:e], a["A"], a["B"][s:e], a["C"][s:e], state, [0, e - s], [0], [s > 0],
            chunk_size=4, **kw,
        ))
    # Decode: Mamba-2's scalars per head expanded over the P channels, as its layer calls the update.
    for t in range(length - 2, length):
        got.append(selective_state_update(
            state, a["x"][t][None], a["dt"][t][None, :, None].expand(1, heads, p),
            a["A"][:, None, None].expand(heads, p, n), a["B"][t][None], a["C"][t][None], torch.tensor([0]),
            D=a["D"][:, None].expand(heads, p), dt_bias=a["dt_bias"][:, None].expand(heads, p), dt_softplus=True,
        )[0][None])
    torch.testing.assert_close(torch.cat(got), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, whole_state, rtol=1e-4, atol=1e-4)
