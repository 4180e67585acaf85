"""`pagedllm config`: show (resolved values and every selection with its reason), schema, validate, docs.

`show` without `--resolve` explains the selections that need no weights (loader, scheduler, logits
processors; the attention backend for this machine); `--resolve` builds the engine and explains them all.
The selections are printed as `#` comments, so the output stays loadable YAML.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

import yaml

from pagedllm.cli.engine_args import add_engine_args, engine_config_from_args
from pagedllm.component_names import COMPONENT_KEYS
from pagedllm.config import ConfigError, EngineConfig, read_config_file

DOCS_PATH = "docs/configuration.md"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="inspect, validate and document configuration")
    csub = p.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the resolved config and every selection with its reason")
    show.add_argument("--resolve", action="store_true", help="build the engine and explain every selection")
    add_engine_args(show)
    show.set_defaults(func=run_show)
    schema = csub.add_parser("schema", help="print the config's JSON schema")
    schema.set_defaults(func=run_schema)
    validate = csub.add_parser(
        "validate", help="validate a config file (plugin names and plugin sections included)"
    )
    validate.add_argument("file", help="YAML or TOML config file")
    validate.set_defaults(func=run_validate)
    docs = csub.add_parser("docs", help=f"print {DOCS_PATH}, generated from the schema")
    docs.add_argument("--output", "-o", help="write to this file instead of stdout")
    docs.set_defaults(func=run_docs)


def run_show(args: argparse.Namespace) -> int:
    cfg = engine_config_from_args(args)
    if args.resolve:
        from pagedllm.engine.builder import build_engine
        from pagedllm.plugin_manager import get_plugin_manager

        get_plugin_manager().load_config(cfg)
        parts = build_engine(cfg)
        # The build's config: what the engine resolved (on the CPU, batch and KV sizes from the machine).
        cfg, text = parts.config, parts.describe()
    else:
        text = preview_selections(cfg)
    print(yaml.safe_dump(cfg.model_dump(), sort_keys=False).rstrip())
    print("\n# selected components" + ("" if args.resolve else " (without loading the model; --resolve for all)"))
    print("\n".join(f"# {line}" for line in text.splitlines()))
    return 0


def preview_selections(cfg: EngineConfig) -> str:
    """Explain every selection that can be made without the model's weights (a failure is shown, not raised)."""
    from pagedllm.cli.plugins_cmd import _attention_context
    from pagedllm.default_model import resolve_model_reference
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind
    from pagedllm.selector import select

    pm = get_plugin_manager()
    lines: list[str] = []

    def explain(label: str, make: Any) -> None:
        try:
            lines.append(make().explain())
        except Exception as exc:  # the point of `show` is to say why, not to stop at the first problem
            lines.append(f"{label}: cannot select: {exc}")

    def loader() -> Any:
        ref = resolve_model_reference(cfg.model)
        return select(pm, PluginKind.LOADER, ref, requested=cfg.loader.name)

    explain("loader", loader)
    ctx = _attention_context()
    explain("attention_backend",
            lambda: select(pm, PluginKind.ATTENTION, ctx, requested=cfg.attention.backend))
    lines.append("  (for this machine; the model's head size and dtype are checked by --resolve)")
    explain("scheduler", lambda: select(pm, PluginKind.SCHEDULER, cfg.scheduler, requested=cfg.scheduler.name))
    for name in cfg.logits_processors:
        explain("logits_processor", lambda n=name: select(pm, PluginKind.LOGITS_PROCESSOR, None, requested=n))
    return "\n".join(lines)


def run_schema(args: argparse.Namespace) -> int:
    print(json.dumps(EngineConfig.model_json_schema(), indent=2))
    return 0


def run_validate(args: argparse.Namespace) -> int:
    """Exit 0 when the file (with environment overrides), the component names it gives and its plugin sections
    are valid; otherwise raise ConfigError, which main() reports with exit status 2."""
    import warnings

    from pagedllm.component_names import check_component_names
    from pagedllm.config import validate_plugin_sections
    from pagedllm.plugin_manager import get_plugin_manager

    cfg = EngineConfig.from_dict(read_config_file(args.file), source=args.file)
    pm = get_plugin_manager()
    check_component_names(cfg, pm, source=args.file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_plugin_sections(cfg, pm.config_models())
    for w in caught:
        if "plugins." in str(w.message):
            print(f"note: {w.message}")
    print(f"{args.file}: valid")
    return 0


def run_docs(args: argparse.Namespace) -> int:
    text = config_docs()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0


# -- docs/configuration.md ------------------------------------------------------------------------------------


def config_docs() -> str:
    """docs/configuration.md, generated from EngineConfig's schema (a test fails when the checked-in copy is stale)."""
    schema = EngineConfig.model_json_schema()
    defs = schema.get("$defs", {})
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `pagedllm config docs -o docs/configuration.md` from the config schema; do not edit. -->",
        "",
        "An engine is assembled from one YAML or TOML file (`--config FILE`, `LLM(config=FILE)`). Every section",
        "forbids unknown keys; errors name the dotted key. Precedence, lowest first:",
        "",
        "1. defaults (below)",
        "2. the config file",
        "3. environment variables `PAGEDLLM_<SECTION>__<KEY>` (`__` between levels, e.g.",
        "   `PAGEDLLM_SCHEDULER__MAX_NUM_SEQS=8`, `PAGEDLLM_PLUGINS__BAN_TOKENS__TOKEN_IDS='[0, 1]'`) or",
        "   `PAGEDLLM_<KEY>` for a top-level key (`PAGEDLLM_MODEL`); values are YAML scalars",
        "4. command-line flags and `--set key.dotted=value`, or `LLM(...)` keyword arguments",
        "",
        "`pagedllm config schema` prints the JSON schema, `pagedllm config validate FILE` checks a file (plugin",
        "sections included) and `pagedllm config show` prints the resolved config with every selection and its",
        "reason. A plugin's own section `plugins.<component name>` is validated by the pydantic model the plugin",
        "registers (`config_model=`, see docs/plugins/README.md); errors name `plugins.<name>.<key>`.",
        "",
        *textwrap.wrap(_VALIDATION_DOCS.format(keys=", ".join(f"`{k}`" for k in COMPONENT_KEYS)), width=108,
                       break_on_hyphens=False, break_long_words=False),
        "",
    ]
    top, sections = [], []
    for key, prop in schema["properties"].items():
        ref = _ref(prop)
        if ref is not None:
            sections.append((key, defs[ref]))
        else:
            top.append((key, prop))
    out += ["## Top level", "", *_table(top, schema.get("required", []))]
    for key, sub in sections:
        out += [f"## `{key}`", ""]
        if sub.get("description"):
            out += [" ".join(sub["description"].split()), ""]
        out += _table(list(sub["properties"].items()), sub.get("required", []), prefix=f"{key}.")
    return "\n".join(out).rstrip() + "\n"


# The paragraph on component-name checks; the keys come from COMPONENT_KEYS, so the list cannot go stale.
_VALIDATION_DOCS = (
    "Every key that names a component ({keys}; each item of a list) is checked against the names the installed "
    "plugins register; `null` means \"choose for me\" (or off). An unknown name is reported with its dotted "
    "key, the names available and, for a near miss, \"did you mean 'X'?\"; every such key is reported, and "
    "`config validate` exits 2. The check reads names only (no plugin is loaded, torch is not imported), so "
    "whether this machine can run the component (flash_attn installed, a GPU) is left to engine start. "
    "`generate`, `serve`, `chat`, `bench` and `config show` run the same check before loading anything, and a "
    "config or selection error there is one line on stderr, `pagedllm: error: <message>`, with exit status 2."
)


def _ref(prop: dict[str, Any]) -> str | None:
    ref = prop.get("$ref") or next((a.get("$ref") for a in prop.get("allOf", [])), None)
    return ref.rsplit("/", 1)[-1] if ref else None


def _type(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "anyOf" in prop:
        return " \\| ".join(_type(p) for p in prop["anyOf"])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list[{_type(prop.get('items', {}))}]"
    if kind == "object":
        return "mapping"
    return {"null": "null", "integer": "int", "number": "float", "boolean": "bool", "string": "str"}.get(kind, kind)


def _table(rows: list[tuple[str, dict[str, Any]]], required: list[str], prefix: str = "") -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, prop in rows:
        bounds = [f"{label} {prop[k]}" for k, label in
                  (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
                  if k in prop]
        empty: Any = {"array": [], "object": {}}.get(prop.get("type", ""))  # default_factory fields carry no default
        default = "required" if key in required else f"`{json.dumps(prop.get('default', empty))}`"
        desc = prop.get("description", "")
        if bounds:
            desc = (desc + f" ({', '.join(bounds)})").strip()
        lines.append(f"| `{prefix}{key}` | {_type(prop)} | {default} | {desc} |")
    return [*lines, ""]


__all__ = ["ConfigError", "config_docs", "preview_selections"]
