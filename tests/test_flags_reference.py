"""docs/flags.md is ``fairseq-agg flags --markdown``'s output, and that output lists every flag of
every component the plugin registers, with the defaults and help of the components' dataclasses."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest
from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
from fairseq.dataclass import FairseqDataclass
from fairseq.optim import OPTIMIZER_DATACLASS_REGISTRY, OPTIMIZER_REGISTRY

from fairseq_agg import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(REPO, "docs", "flags.md")


def test_docs_flags_md_is_the_commands_output():
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "fairseq-agg"), "flags", "--markdown"],
                          capture_output=True, text=True, check=True)
    with open(REFERENCE, encoding="utf-8") as f:
        committed = f.read()
    assert committed == proc.stdout, (
        f"docs/flags.md is out of date: regenerate it with `{flags.REFERENCE_COMMAND}` (in the repository root)")


def _switch(value):
    return "on" if value else "off"


def _dataclass_rows(dataclass, stock_dataclass=None):
    """flag -> (default, help) of the fields that add a flag: not the stock counterpart's, and not
    II("...") fields, which are interpolated from fairseq's own options."""
    stock = {f.name for f in dataclasses.fields(stock_dataclass)} if stock_dataclass else set()
    rows = {}
    for field in dataclasses.fields(dataclass):
        if field.name in stock or str(field.default).startswith("${") or field.name == "_name":
            continue
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        default = _switch(default) if isinstance(default, bool) else default
        rows["--" + field.name.replace("_", "-")] = (str(default), " ".join(field.metadata.get("help", "").split()))
    return rows


def _component_rows(name):
    return {row.flag: (str(row.default), row.help) for row in flags.flag_rows(name)}


@pytest.mark.parametrize("name", flags.plugin_criteria())
def test_criterion_flags_are_its_dataclass_fields(name):
    """The rows agree with the criterion's dataclass, read independently of fairseq's parser."""
    expected = _dataclass_rows(CRITERION_DATACLASS_REGISTRY[name],
                               CRITERION_DATACLASS_REGISTRY[flags.stock_criterion(name)])
    assert _component_rows(name) == expected


@pytest.mark.parametrize("name", flags.plugin_components("--optimizer"))
def test_optimizer_flags_are_its_dataclass_fields(name):
    assert _component_rows(name) == _dataclass_rows(OPTIMIZER_DATACLASS_REGISTRY[name])


def test_a_default_of_none_reads_unset_and_its_help_says_what_then_applies():
    text = flags.reference_markdown()
    assert "`None`" not in text
    unset_rows = [line for line in text.splitlines() if line.startswith("| `--") and "| *unset* |" in line]
    assert unset_rows, "no flag of the plugin defaults to None any more: drop this test"
    for line in unset_rows:
        assert "unset: " in line.split("| *unset* |", 1)[1], line
    assert "(default: unset)" in flags.describe("cross_entropy_with_stats")


def _reference_tables(text):
    """section title -> [flag, ...] of its table."""
    tables = {}
    title = None
    for line in text.splitlines():
        if line.startswith("### "):
            title = line[4:]
            tables[title] = []
        found = re.match(r"\| `(--[\w-]+)` \|", line)
        if found:
            tables[title].append(found.group(1))
    return tables


def test_each_flag_of_a_criterion_is_in_exactly_one_section_that_applies_to_it():
    text = flags.reference_markdown()
    tables = _reference_tables(text)
    sections = dict(flags.reference_sections())["Criteria (`--criterion`)"]
    for name in flags.plugin_criteria():
        own = next(s for s in sections if s.title == f"`--criterion {name}`")
        listed = tables[own.title] + [flag for title in own.also for flag in tables[title]]
        assert sorted(listed) == sorted(row.flag for row in flags.flag_rows(name)), name
    every = [title for title in tables if title == "Flags of every criterion"]
    assert every and "--embed-stats-interval" in tables[every[0]]
    assert sum(flag == "--embed-stats-interval" for flags_ in tables.values() for flag in flags_) == 1
    # the links to the shared sections point at their headings
    for anchor in re.findall(r"\]\((#[^)]+)\)", text):
        assert any(flags.anchor(title) == anchor for title in tables), anchor


@dataclasses.dataclass
class _ExampleOptimizerConfig(FairseqDataclass):
    example_rate: float = dataclasses.field(default=0.25, metadata={"help": "how fast it goes"})


class _ExampleOptimizer:
    """Stands for an optimizer the plugin would register (its class lives in fairseq_agg)."""


def test_a_registered_optimizer_of_the_plugin_is_in_the_reference(monkeypatch):
    monkeypatch.setattr(_ExampleOptimizer, "__module__", "fairseq_agg.optim.example")
    monkeypatch.setattr(_ExampleOptimizer, "__dataclass", _ExampleOptimizerConfig, raising=False)
    monkeypatch.setitem(OPTIMIZER_REGISTRY, "example_optimizer", _ExampleOptimizer)
    monkeypatch.setitem(OPTIMIZER_DATACLASS_REGISTRY, "example_optimizer", _ExampleOptimizerConfig)
    assert "example_optimizer" in flags.plugin_components("--optimizer")
    text = flags.reference_markdown()
    assert "## Optimizers (`--optimizer`)" in text
    section = text.split("### `--optimizer example_optimizer`\n", 1)[1].split("###", 1)[0]
    assert "| `--example-rate` | `0.25` | how fast it goes |" in section


class _ExampleOutputCriterion:
    """Stands for an output-layer criterion the plugin would register (its config has --output-kernel)."""


class _ExamplePlainCriterion:
    """Stands for a criterion of the plugin without the fused output layer."""


def test_the_criteria_that_take_output_kernel_are_read_from_the_registry(monkeypatch):
    # study/run.py adds --output-kernel only to runs of these: the plugin's criteria whose config has
    # the flag, read from fairseq's registry, so that a new criterion counts without a list to edit
    from fairseq.criterions import CRITERION_REGISTRY

    from fairseq_agg.criterions.output_loss import OutputLossConfig, OutputLossCriterion
    from fairseq_agg.fairseq_facts.flag_choices import plugin_criteria_taking
    registered = plugin_criteria_taking("output_kernel")
    own = {name: cls for name, cls in CRITERION_REGISTRY.items() if cls.__module__.startswith("fairseq_agg.")}
    assert set(registered) == {name for name, cls in own.items() if issubclass(cls, OutputLossCriterion)}
    assert "cross_entropy_agg" in registered and "cross_entropy_with_stats" not in registered
    for cls, config, name in ((_ExampleOutputCriterion, OutputLossConfig, "example_output"),
                              (_ExamplePlainCriterion, _ExampleOptimizerConfig, "example_plain")):
        monkeypatch.setattr(cls, "__module__", f"fairseq_agg.criterions.{name}")
        monkeypatch.setitem(CRITERION_REGISTRY, name, cls)
        monkeypatch.setitem(CRITERION_DATACLASS_REGISTRY, name, config)
    assert plugin_criteria_taking("output_kernel") == tuple(sorted(registered + ("example_output",)))
