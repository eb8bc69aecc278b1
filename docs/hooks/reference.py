"""MkDocs hook: the generated reference pages, written into the build from the code itself.

- ``reference/config.md``: the ``"resilience"`` section, from the dataclasses of
  ``ds_resilience/config.py`` (each field's type, default, allowed values and doc, which live in
  the field's metadata);
- ``reference/cli.md``: every ``ds-resilience`` subcommand, from ``ds_resilience.cli.subcommand_parsers()``;
- ``reference/layers.md``: the package's layers, from ``LAYERS`` in ``tests/unit/test_layering.py``
  (the map the layering test enforces), with each module's first docstring line.

Nothing generated is committed: these pages exist only in the build, so they cannot drift.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAGES = {
    "reference/config.md": "config_page",
    "reference/cli.md": "cli_page",
    "reference/layers.md": "layers_page",
}


def on_files(files: Files, config: Any) -> Files:
    """Add the generated pages to the build (the nav in mkdocs.yml names them)."""
    for uri, builder in PAGES.items():
        files.append(File.generated(config, uri, content=globals()[builder]()))
    return files


def _prose(text: Any) -> str:
    """A docstring's reST for Markdown: ``:role:`x``` and double backticks become code spans."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", str(text))
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _cell(text: Any) -> str:
    """``text`` as one Markdown table cell."""
    return " ".join(_prose(text).split()).replace("|", "\\|")


def _code(text: Any) -> str:
    return f"`{text}`" if "`" not in str(text) else f"`` {text} ``"


# --------------------------------------------------------------------------- configuration
def _json(value: Any) -> str:
    import json

    from ds_resilience.config import _dump

    return json.dumps(_dump(value))


def _type_text(spec: Any) -> str:
    from ds_resilience.config import _Section

    if spec.types == (tuple,) and spec.items is not None:
        inner = spec.items
        if any(isinstance(t, type) and issubclass(t, _Section) for t in inner.types):
            text = "list of objects"
        else:
            text = f"list of {inner.what.removeprefix('a ').removeprefix('an ')}s"
        if spec.unique:
            text += ", no duplicates"
    else:
        text = spec.what.removeprefix("a ").removeprefix("an ")
    return text + (" or null" if spec.nullable else "")


def _allowed(spec: Any) -> str:
    parts = []
    if spec.choices is not None:
        parts.append(", ".join(_code(f'"{c}"' if isinstance(c, str) else c) for c in spec.choices))
    if spec.bounds():
        parts.append(spec.bounds())
    if spec.items is not None and spec.items.choices is not None:
        parts.append("each one of " + ", ".join(_code(c) for c in spec.items.choices))
    return "; ".join(parts)


def _section_rows(cls: type, prefix: str, out: list[str], sections: list[tuple[str, type]]) -> None:
    from ds_resilience.config import _Section

    out.append("| key | type | default | allowed | meaning |")
    out.append("| --- | --- | --- | --- | --- |")
    for f in dataclasses.fields(cls):
        spec, doc = f.metadata["spec"], f.metadata["doc"]
        key = f"{prefix}{f.name}"
        section = next((t for t in spec.types if isinstance(t, type) and issubclass(t, _Section)), None)
        item_section = None
        if spec.items is not None:
            item_section = next((t for t in spec.items.types if isinstance(t, type) and issubclass(t, _Section)), None)
        if f.default is not dataclasses.MISSING:
            default = _code(_json(f.default))
        elif f.default_factory is not dataclasses.MISSING and section is None:
            default = _code(_json(f.default_factory()))
        elif section is not None:
            default = "the section's defaults"
        else:
            default = "required"
        meaning = doc
        if section is not None:
            anchor = key.replace(".", "").lower()
            meaning = f"{doc}: see [{key}](#{anchor})"
            sections.append((key, section))
        elif item_section is not None:
            anchor = (key + "[]").replace(".", "").replace("[]", "").lower()
            meaning = f"{doc}: each entry as in [{key}[]](#{anchor})"
            sections.append((key + "[]", item_section))
        out.append(f"| {_code(key)} | {_cell(_type_text(spec))} | {default} | {_cell(_allowed(spec))} | "
                   f"{_cell(meaning)} |")


def config_page() -> str:
    from ds_resilience.config import ResilienceConfig

    out = [
        "# Configuration reference",
        "",
        "*Generated at build time from `ds_resilience/config.py` (the dataclasses' field metadata), so "
        "it always matches the code.*",
        "",
        "The `\"resilience\"` section of a DeepSpeed JSON config (Megatron's `--resilience-config` reads "
        "the same section, or a file holding the section alone). It is parsed strictly at "
        "`ds_resilience.initialize`: an unknown key, a value of the wrong type (`true` is not an "
        "integer; an integer is a number) or out of range raises `ConfigError` naming the full key "
        "path, the value and what is allowed. A missing section gives the defaults. "
        "`configs/default_resilience.json` is a complete CPU DeepSpeed config with every key at its "
        "default.",
        "",
        "```json",
        '{"train_batch_size": 16, "gradient_accumulation_steps": 4,',
        ' "resilience": {"max_failures": 1, "planner": {"solver": "cpsat"}, "checkpoint": {"replicas": 2}}}',
        "```",
        "",
    ]
    pending: list[tuple[str, type]] = [("resilience", ResilienceConfig)]
    while pending:
        key, cls = pending.pop(0)
        out.append(f"## {key}")
        out.append("")
        out.append(_cell((cls.__doc__ or "").strip().split("\n\n")[0]) if cls is not ResilienceConfig
                   else "The top-level keys of the section.")
        out.append("")
        found: list[tuple[str, type]] = []
        prefix = "" if cls is ResilienceConfig else key + "."
        _section_rows(cls, prefix, out, found)
        out.append("")
        pending.extend(found)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- command line
def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    try:
        return parser._get_formatter()._expand_help(action)
    except (KeyError, TypeError, ValueError):
        return action.help


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | value | default | help |", "| --- | --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(action.option_strings) or action.dest
        if action.nargs == 0:
            value = ""
        elif action.choices is not None:
            value = " \\| ".join(_code(c) for c in action.choices)
        else:
            value = _code(action.metavar or (action.dest.upper() if action.option_strings else action.dest))
        if action.nargs == argparse.REMAINDER:
            value = "the rest of the command line"
        required = action.required or not action.option_strings
        if required:
            default = "required"
        elif action.default is None or action.default is False or action.default == [] \
                or action.default == argparse.SUPPRESS:
            default = ""
        else:
            default = _code(action.default)
        rows.append(f"| {_code(names)} | {value} | {default} | {_cell(_help(parser, action))} |")
    return rows


def cli_page() -> str:
    from ds_resilience.cli import build_parser, subcommand_parsers

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps usage at the terminal's width
    try:
        parsers = subcommand_parsers()
        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        summaries = {c.dest: c.help for c in sub._choices_actions}
        out = [
            "# Command-line reference",
            "",
            "*Generated at build time from the argument parsers (`ds_resilience.cli.subcommand_parsers()`), so "
            "it always matches the code.*",
            "",
            "`ds-resilience COMMAND ...`; `ds-resilience COMMAND --help` prints the same. The pure commands "
            "(`plan`, `plan-table`, `simulate`, `placement`, `templates`) never import torch.",
            "",
            "| command | what it does |",
            "| --- | --- |",
        ]
        out += [f"| [`{name}`](#ds-resilience-{name}) | {_cell(summaries.get(name) or '')} |" for name in parsers]
        out.append("")
        for name, parser in parsers.items():
            out += [f"## ds-resilience {name}", ""]
            text = parser.description or summaries.get(name) or ""
            if text:
                out += [_cell(text), ""]
            out += ["```text", parser.format_usage().strip(), "```", ""]
            out += _argument_rows(parser)
            for group in parser._mutually_exclusive_groups:
                names = ", ".join(_code(a.option_strings[0]) for a in group._group_actions)
                out += ["", f"One of {names}" + (" is required." if group.required else " at most.")]
            out.append("")
        return "\n".join(out) + "\n"
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


# --------------------------------------------------------------------------- layers
def _layering_module() -> Any:
    path = ROOT / "tests" / "unit" / "test_layering.py"
    spec = importlib.util.spec_from_file_location("_dsr_docs_test_layering", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(module: str) -> str:
    """First line of a module's docstring, read with ast (nothing is imported)."""
    rel = Path(*module.split("."))
    for path in (ROOT / rel / "__init__.py", ROOT / rel.with_suffix(".py")):
        if path.exists():
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            return doc.strip().split("\n\n")[0]
    return ""


def _layer_titles() -> dict[int, str]:
    """The ``# L<n>: ...`` comments in LAYERS (a comment may go on over the next ``#`` lines; a
    layer with several comments gets them joined)."""
    text = (ROOT / "tests" / "unit" / "test_layering.py").read_text(encoding="utf-8")
    titles: dict[int, list[list[str]]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        match = re.match(r"# L(\d+): (.+)$", stripped)
        if match:
            current = [match.group(2).strip()]
            titles.setdefault(int(match.group(1)), []).append(current)
        elif current is not None and stripped.startswith("#"):
            current.append(stripped.lstrip("#").strip())
        else:
            current = None
    return {layer: "; ".join(" ".join(parts) for parts in comments) for layer, comments in titles.items()}


def layers_page() -> str:
    layering = _layering_module()
    titles = _layer_titles()
    by_layer: dict[int, list[str]] = {}
    for module, layer in layering.LAYERS.items():
        by_layer.setdefault(layer, []).append(module)
    out = [
        "# Layers",
        "",
        "*Generated at build time from `LAYERS` in `tests/unit/test_layering.py`, the map the layering "
        "test enforces, so it always matches the code.*",
        "",
        "Imports only go down (within a layer, sideways), and the module graph has no cycle: the test "
        "parses every module of `ds_resilience/` (function-local and `TYPE_CHECKING` imports included) and "
        "checks both, and that the pure layers and the CLI load without torch, deepspeed, megatron, "
        "triton or matplotlib (and that `ds_resilience.megatron`'s argument hooks load without them too). "
        "A module belongs to the layer of its longest mapped prefix; the package root matches only "
        "itself. Only `integrations/` imports deepspeed (and `accelerator.py`, lazily, for DeepSpeed's "
        "accelerator when a tensor is on a device).",
        "",
        "| layer | what | modules |",
        "| --- | --- | --- |",
    ]
    for layer in sorted(by_layer, reverse=True):
        modules = "<br>".join(_code(m) for m in by_layer[layer])
        out.append(f"| L{layer} | {_cell(titles.get(layer, ''))} | {modules} |")
    out += ["", "## Modules", "",
            "Every module of the package with the first paragraph of its docstring, by layer."]
    modules = sorted(layering.discover(), key=lambda m: (-(layering.layer_of(m) or 0), m))
    current = None
    for module in modules:
        layer = layering.layer_of(module)
        if layer != current:
            current = layer
            out += ["", f"### L{layer}", "", "| module | summary |", "| --- | --- |"]
        out.append(f"| {_code(module)} | {_cell(_summary(module))} |")
    out.append("")
    return "\n".join(out) + "\n"
