"""The reference pages, generated from the code at build time (an MkDocs hook).

A page holds a marker such as ``<!-- reference: config -->``; ``on_page_markdown`` replaces it with a
table built from the code that defines the thing: the config dataclasses (``spikingsail.config``),
the argparse parsers of every ``sail`` subcommand, the differential matrix's cells
(``tests/matrix/cells.py``) and the package's public names. Nothing in those tables is written by
hand, so they cannot fall out of date; ``tests/docs/test_reference.py`` fails when a key, flag or
public name has no description.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _importable() -> None:
    """The package and the tests (the matrix) importable from the checkout; MkDocs resets sys.path
    after loading a hook, so every generator calls this."""
    for path in (ROOT / "src", ROOT):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


MARKER = re.compile(r"<!-- reference: ([a-z-]+) -->")


@dataclass(frozen=True)
class Row:
    """One documented thing: a config key, a CLI flag or a public name."""

    name: str
    kind: str
    default: str
    allowed: str
    description: str


# --- config ------------------------------------------------------------------------------------


def field_docs(cls: type[Any]) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (the string literal after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _literal_values(annotation: str) -> str:
    choices = re.findall(r"Literal\[([^\]]*)\]", annotation)
    return " | ".join(c.replace("'", '"') for c in choices)


def _default(spec: dataclasses.Field[Any]) -> str:
    """The default as JSON writes it (false, null, [])."""
    if spec.default is not dataclasses.MISSING:
        value = spec.default
    elif spec.default_factory is not dataclasses.MISSING:
        value = spec.default_factory()
    else:
        return "required"
    try:
        return json.dumps(value)
    except TypeError:  # a section's dataclass: its keys have rows of their own
        return "see its keys"


def _allowed(spec: dataclasses.Field[Any]) -> str:
    annotation = str(spec.type)
    allowed = spec.metadata.get("range")
    if allowed is not None:
        return str(allowed.describe())
    if spec.metadata.get("parse") == "trackers":
        from spikingsail.monitor.trackers import TRACKERS

        return " | ".join(f'"{name}"' for name in TRACKERS) + " (a list)"
    literal = _literal_values(annotation)
    if literal:
        return literal + (" (any case)" if spec.metadata.get("any_case") else "")
    if annotation.startswith("bool"):
        return "true | false" + (" | null" if "None" in annotation else "")
    return ""


def _section_rows(prefix: str, cls: type[Any]) -> Iterator[Row]:
    docs = field_docs(cls)
    for spec in dataclasses.fields(cls):
        annotation = str(spec.type)
        kind = (
            re.sub(r"Literal\[[^\]]*\]", "str", annotation).replace("tuple[", "list[").replace(", ...]", "]")
        )
        yield Row(f"{prefix}.{spec.name}", kind, _default(spec), _allowed(spec), docs.get(spec.name, ""))


def config_rows() -> list[Row]:
    """Every key the config parser accepts, in the order of its table."""
    from spikingsail.backends import config_sections
    from spikingsail.config import parse, schema, zero

    top = field_docs(schema.SailConfig)
    top_fields = {f.name: f for f in dataclasses.fields(schema.SailConfig)}
    batch_range = parse._BATCH_RANGE.describe()
    # DeepSpeed's rule (parse._resolve_batch): any two imply the third; one of the first two is required
    defaults = {
        "train_batch_size": "micro × accumulation × processes (required unless the micro batch is given)",
        "train_micro_batch_size_per_gpu": "train_batch_size ÷ (accumulation × processes) (required unless "
        "train_batch_size is given)",
        "gradient_accumulation_steps": "1; with the other two given, train_batch_size ÷ (micro × processes)",
    }
    rows = [Row(key, "int", defaults[key], batch_range, top.get(key, "")) for key in parse.BATCH_KEYS]
    for key in parse._SCALARS:
        spec = top_fields[key]
        rows.append(Row(key, str(spec.type), _default(spec), _allowed(spec), top.get(key, "")))
    for name, found in parse._SECTIONS.items():
        if name != found.field:
            rows.append(Row(f"{name}.*", "section", "", "", f"Another name for the `{found.field}` section."))
        elif name != "zero_optimization":  # DeepSpeed's keys, below
            rows.extend(_section_rows(name, found.cls))
    for name, cls in config_sections().items():
        rows.extend(_section_rows(name, cls))
    rows.append(Row("zero_optimization", "bool or section", "false", "true | false | {...}",
                    "DeepSpeed's legacy form: true is stage 1; or a section of the keys below."))  # fmt: skip
    zero_docs = field_docs(schema.ZeroConfig)
    for key, kind in zero.ZERO_KEYS.items():
        allowed = kind if isinstance(kind, str) else kind.describe()
        text = zero_docs.get(key) or (
            "DeepSpeed's key with DeepSpeed's meaning, checked by the installed DeepSpeed's config class "
            "under every backend (and any other key it has): the deepspeed backend hands it to DeepSpeed, "
            "the others read only stage and name the rest in a warning. Where DeepSpeed does not import, "
            "it is checked with DeepSpeed 0.19.8's type and bounds."
        )
        rows.append(Row(f"zero_optimization.{key}", "", "DeepSpeed's", str(allowed), text))
    for key in sorted(parse.INERT_DEEPSPEED_KEYS):
        rows.append(Row(key, "any", "", "", "DeepSpeed's key, accepted so that a DeepSpeed file loads; "
                        "a warning names it when the chosen backend does not act on it. Where DeepSpeed "
                        "is installed, every top-level key its config class reads is accepted, and "
                        "checked by it."))  # fmt: skip
    return rows


# --- command line ------------------------------------------------------------------------------


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every ``sail`` subcommand's parser, and the flags a training script gets from the engine."""
    from spikingsail.cli import bench, checkpoint, doctor, report
    from spikingsail.engine.initialize import add_config_arguments
    from spikingsail.launchers import k8s, request, sbatch

    parsers = {
        "sail launch": request.parser(),
        "sail submit": sbatch.parser(),
        "sail submit --target k8s": k8s.parser(),
        "sail doctor": doctor.parser(),
        "sail bench comm": bench.comm_parser(),
        "sail report": report.parser(),
    }
    for action in checkpoint.parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parsers[f"sail checkpoint {name}"] = sub
    script = argparse.ArgumentParser(prog="your_script.py", add_help=False)
    parsers["your script (spikingsail.add_config_arguments)"] = add_config_arguments(script)
    return parsers


def commands_covered() -> set[str]:
    """The first word after ``sail`` of every parser documented."""
    return {name.split()[1] for name in cli_parsers() if name.startswith("sail ")}


def flag_rows(parser: argparse.ArgumentParser) -> list[Row]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if (
            action.help == argparse.SUPPRESS
        ):  # hidden from --help on purpose (torch.distributed.launch's --local_rank)
            continue
        name = ", ".join(action.option_strings) or action.metavar or action.dest
        if action.choices:
            allowed = " | ".join(str(c) for c in action.choices)
        elif action.nargs == 0:
            allowed = "flag"
        else:
            allowed = str(action.metavar or action.dest.upper())
        default = action.default
        shown = "" if default in (None, argparse.SUPPRESS, False) else str(default)
        description = action.help or ""
        if "%(default)" in description:
            description = description % {"default": default}
        rows.append(Row(str(name), "", shown, allowed, description))
    return rows


# --- differential matrix -----------------------------------------------------------------------


def _constant_docs(module: Any) -> dict[str, str]:
    """The docstrings written under a module's constants."""
    body = ast.parse(inspect.getsource(module)).body
    docs = {}
    for node, following in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.targets[0].id] = " ".join(following.value.value.split())
    return docs


def matrix_axes() -> dict[str, tuple[list[str], str]]:
    """Every field of a matrix cell, with the values it takes in the cells and the docstring of the
    constant that lists them (``topology`` → ``TOPOLOGIES``)."""
    from tests.matrix import cells

    every = cells.all_cells()
    docs = _constant_docs(cells)
    axes = {}
    for spec in dataclasses.fields(cells.Cell):
        values = list(dict.fromkeys(str(getattr(cell, spec.name)) for cell in every))
        if spec.name == "backend":
            values = [f"`{n}` (sail.backend {b}, ZeRO stage {s})" for n, (b, s) in cells.BACKENDS.items()]
        plural = spec.name.upper()
        names = (plural + "S", plural[:-1] + "IES", plural + "ES")
        axes[spec.name] = (values, next((docs[n] for n in names if n in docs), ""))
    return axes


def matrix_markdown() -> str:
    from tests.matrix import cells

    every = cells.all_cells()
    lines = [
        f"{len(every)} cells: {cells.WORLD} ranks, {cells.STEPS} optimizer steps, interrupted cells stop "
        f"after step {cells.STOP_STEP}. Each runs with `python -m tests.matrix --cell ID`; CI runs a "
        f"seeded sample of {cells.SAMPLE_SIZE} that covers every value of {', '.join(cells.AXES)}.",
        "",
        "| axis | values | what they are |",
        "| --- | --- | --- |",
        *(
            f"| {axis} | {', '.join(values)} | {_cell(why)} |"
            for axis, (values, why) in matrix_axes().items()
        ),
        "",
        "What each cell guarantees (grouped; the count is the number of cells):",
        "",
        "| cells | guarantee | why | example cell |",
        "| --- | --- | --- | --- |",
    ]
    groups: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for cell in every:
        if cell.refusal:
            key = (
                f"refused with a message containing `{cell.refusal}`",
                "a clear refusal instead of a wrong result",
            )
        else:
            tol = cell.tolerance
            key = (
                f"final weights and lr equal one process's within rtol {tol.rtol:g}, atol {tol.atol:g}",
                tol.why,
            )
        groups[key].append(cell.id)
    for (guarantee, why), ids in groups.items():
        lines.append(f"| {len(ids)} | {guarantee} | {why} | `{ids[0]}` |")
    return "\n".join(lines)


# --- Python API --------------------------------------------------------------------------------


def public_names() -> dict[str, str]:
    """``spikingsail.__all__``, each with the module that defines it."""
    import spikingsail

    where = {}
    for name in spikingsail.__all__:
        value = getattr(spikingsail, name)
        module = getattr(value, "__module__", "spikingsail")
        where[name] = f"{module}.{name}"
    return where


def api_markdown() -> str:
    """One block per public name; a class also shows what it takes from spikingsail's own bases
    (the engine's DeepSpeed-named calls)."""
    import spikingsail

    blocks = []
    for name, path in public_names().items():
        value = getattr(spikingsail, name)
        inherits = isinstance(value, type) and any(
            base.__module__.startswith("spikingsail.") for base in value.__mro__[1:]
        )
        blocks.append(
            f"## `spikingsail.{name}`\n\n::: {path}\n    options:\n      show_root_heading: false\n"
            + ("      inherited_members: true\n" if inherits else "")
        )
    return "\n".join(blocks)


# --- rendering ---------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(
    rows: list[Row], columns: tuple[str, ...] = ("key", "type", "default", "allowed", "meaning")
) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        values = [f"`{row.name}`", row.kind, row.default, row.allowed, row.description]
        if "type" not in columns:
            values.pop(1)
        out.append("| " + " | ".join(_cell(v) if i else v for i, v in enumerate(values)) + " |")
    return "\n".join(out)


def config_markdown() -> str:
    return table(config_rows())


def cli_markdown() -> str:
    parts = []
    for name, parser in cli_parsers().items():
        description = " ".join((parser.description or "").split())
        parts.append(
            f"## `{name}`\n\n{description}\n\n"
            + table(flag_rows(parser), ("flag", "default", "value", "meaning"))
        )
    return "\n\n".join(parts)


def deviations_markdown(peer: str) -> str:
    from spikingsail.launchers.deviations import table

    return table(peer)


def deepspeed_flags_markdown() -> str:
    from spikingsail.launchers.deepspeed_flags import table

    return table()


GENERATORS: dict[str, Callable[[], str]] = {
    "deviations-deepspeed": lambda: deviations_markdown("DeepSpeed"),
    "deepspeed-flags": deepspeed_flags_markdown,
    "deviations-horovod": lambda: deviations_markdown("Horovod"),
    "config": config_markdown,
    "cli": cli_markdown,
    "matrix": matrix_markdown,
    "api": api_markdown,
}


def render(markdown: str) -> str:
    _importable()
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


def on_config(config: typing.Any, **_: typing.Any) -> typing.Any:
    """Every page's footer names the version the site documents: the one in this checkout."""
    _importable()
    from spikingsail import __version__

    config["copyright"] = f"SpikingSail {__version__}: built from the source of this version"
    return config


def on_page_markdown(markdown: str, **_: typing.Any) -> str:
    return render(markdown)
