"""The reference pages are generated from the code, and cover all of it: every config key, every flag
of every ``sail`` subcommand, every public name, every cell of the differential matrix."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re

import pytest

import spikingsail
from spikingsail.backends import config_sections
from spikingsail.cli import main
from spikingsail.config import parse
from tests.docs.site import reference
from tests.docs.snippets import ROOT, pages
from tests.matrix.cells import Cell, all_cells


def test_every_config_key_has_a_row_with_a_description() -> None:
    ref = reference()
    rows = ref.config_rows()
    undescribed = [row.name for row in rows if not row.description.strip()]
    assert not undescribed, f"config keys without a description (a docstring under the field): {undescribed}"
    names = {row.name for row in rows}
    top = {name.split(".")[0] for name in names}
    accepted = parse.TOP_LEVEL_KEYS | parse.INERT_DEEPSPEED_KEYS | config_sections().keys()
    assert accepted <= top, f"keys the parser accepts missing from the reference: {accepted - top}"
    own = {k: found.cls for k, found in parse._SECTIONS.items() if k == found.field != "zero_optimization"}
    sections = {**own, **config_sections()}
    for section, cls in sections.items():
        for spec in dataclasses.fields(cls):
            assert f"{section}.{spec.name}" in names


def test_the_key_table_shows_types_defaults_and_ranges() -> None:
    rows = {row.name: row for row in reference().config_rows()}
    assert rows["sail.dist_backend"].allowed == '"auto", "nccl", "gloo"'
    assert rows["sail.dist_backend"].default == '"auto"'
    assert rows["sail.timeout_minutes"].default == "30.0"
    assert rows["sail.seed"].allowed == "an integer from 0 to 2**32-1"
    assert (rows["fp16.enabled"].allowed, rows["fp16.enabled"].default) == ("true | false", "false")
    assert rows["sail.trackers"].kind == "list[str]"
    assert rows["horovod.op"].allowed.endswith("(any case)")


def test_a_field_without_a_docstring_is_found() -> None:
    @dataclasses.dataclass
    class Section:
        documented: int = 1
        """Has one."""
        bare: int = 2

    assert reference().field_docs(Section) == {"documented": "Has one."}


def test_every_sail_command_is_in_the_reference() -> None:
    assert reference().commands_covered() == set(main._COMMANDS)


@pytest.mark.parametrize("command", list(reference().cli_parsers()))
def test_every_flag_has_a_description(command: str) -> None:
    ref = reference()
    rows = ref.flag_rows(ref.cli_parsers()[command])
    assert rows, f"{command}: no flags read from its parser"
    assert not [row.name for row in rows if not row.description.strip()], f"{command}: flags without help"


def test_the_launch_reference_has_torchruns_flags_and_ours() -> None:
    ref = reference()
    names = {row.name for row in ref.flag_rows(ref.cli_parsers()["sail launch"])}
    assert {"--nproc-per-node, --nproc_per_node", "-H, --hostfile, --hosts, -hostfile", "--dry-run"} <= names


def test_every_public_name_has_a_docstring_and_a_section() -> None:
    ref = reference()
    missing = [name for name in spikingsail.__all__ if not inspect.getdoc(getattr(spikingsail, name))]
    assert not missing, f"public names without a docstring: {missing}"
    members = [
        f"{name}.{member}"
        for name in spikingsail.__all__
        if inspect.isclass(cls := getattr(spikingsail, name))
        for member, value in vars(cls).items()
        if not member.startswith("_")
        and (callable(value) or isinstance(value, property | functools.cached_property))
        and not inspect.getdoc(value.fget if isinstance(value, property) else value)
    ]
    assert not members, f"public methods and properties without a docstring: {members}"
    page = ref.api_markdown()
    for name, path in ref.public_names().items():
        assert f"::: {path}\n" in page, name


def test_the_matrix_reference_counts_every_cell_once() -> None:
    page = reference().matrix_markdown()
    counts = [
        int(line.split("|")[1])
        for line in page.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ]
    assert sum(counts) == len(all_cells())
    assert f"{len(all_cells())} cells" in page
    assert "which backend deepspeed does not support" in page


def test_the_matrix_reference_has_every_axis_of_a_cell() -> None:
    axes = reference().matrix_axes()
    assert list(axes) == [spec.name for spec in dataclasses.fields(Cell)]
    for axis, (values, _) in axes.items():
        assert len(values) == len({getattr(cell, axis) for cell in all_cells()}), axis
    assert axes["topology"][1].startswith("2 gloo ranks of one job")


def test_the_marker_is_replaced_and_an_unknown_one_fails() -> None:
    ref = reference()
    assert "`sail.backend`" in ref.render("# Config\n\n<!-- reference: config -->\n")
    with pytest.raises(KeyError):
        ref.render("<!-- reference: nothing -->")


_DOTTED_KEY = re.compile(
    r"`((?:sail|snn|checkpoint|fp16|bf16|fault_tolerance|horovod|zero_optimization)\.[A-Za-z_*]+)`"
)


def test_every_config_key_a_page_names_exists() -> None:
    """Prose and hand-made tables name keys too: each one must be a key the parser accepts (``prefix_*``
    stands for the keys that start so)."""
    keys = {row.name for row in reference().config_rows()}
    unknown = set()
    for page in pages():
        for name in _DOTTED_KEY.findall(page.read_text()):
            wildcard = name.endswith("*") and any(k.startswith(name.rstrip("*").rstrip(".")) for k in keys)
            if name not in keys and not wildcard:
                unknown.add(f"{page.relative_to(ROOT)}: `{name}`")
    assert not unknown, "pages name config keys that do not exist:\n" + "\n".join(sorted(unknown))


def _sail_commands(text: str) -> list[str]:
    """The sail command lines of a page: inline code, and lines of code blocks."""
    inline = re.findall(r"`(sail [a-z][^`]*)`", text)
    lines = [line.strip() for line in text.splitlines() if re.match(r"\s*sail [a-z]+(?: |$)", line)]
    return [command.split("#")[0].replace("\\", " ") for command in inline + lines]


def test_every_sail_flag_a_page_uses_exists() -> None:
    """The flags before the script in every ``sail ...`` command a page shows are flags of that
    command's parser (``sail doctor`` and ``sail bench comm`` also take ``sail launch``'s)."""
    parsers = {name: p for name, p in reference().cli_parsers().items() if name.startswith("sail ")}
    launch = set(parsers["sail launch"]._option_string_actions)
    unknown = set()
    for page in pages():
        for command in _sail_commands(page.read_text()):
            words = command.split()
            name = max((n for n in parsers if words[: len(n.split())] == n.split()), key=len, default=None)
            assert name, f"{page.relative_to(ROOT)}: `{command}` is no sail command"
            known = set(parsers[name]._option_string_actions)
            if name in ("sail doctor", "sail bench comm"):
                known |= launch
            for word in words[len(name.split()) :]:
                if word.endswith(".py") or word in ("-m", "...", "…"):
                    break  # the script, and its own arguments after it
                if word.startswith("-") and word.split("=")[0] not in known:
                    unknown.add(f"{page.relative_to(ROOT)}: {word} in `{command.strip()}`")
    assert not unknown, "pages use sail flags that do not exist:\n" + "\n".join(sorted(unknown))
