"""The use cases (attnctl.app): requests in, plain reports out, nothing printed.

The CLI's output is held by the golden files and the other tests; these hold the layer
between: a use case prints nothing (progress and warnings go through its hooks), its
report carries what the views need (statistics, windows, variant tables), and the CLI
renders exactly that report.
"""

from __future__ import annotations

import contextlib
import json
import re

import pytest

import attnctl.memory.resources as resources
from attnctl.app import (
    CheckRequest,
    Hooks,
    LayerRequest,
    MemoryRequest,
    RunRequest,
    ShapesRequest,
    check_use_case,
    memory_use_case,
    resolve_layer,
    run_use_case,
    shapes_use_case,
)
from attnctl.errors import AttnctlError
from attnctl.memory.estimate import variant_table
from attnctl.render import memory_json, run_json, shapes_json
from attnctl.stats import PATTERNS, head_stats

CPU = LayerRequest({"device": "cpu"})


class Recorded:
    """Hooks that note what a use case announces instead of showing it."""

    def __init__(self) -> None:
        self.progress: list[str] = []
        self.warnings: list[str] = []

    def hooks(self) -> Hooks:
        @contextlib.contextmanager
        def progress(description: str):
            self.progress.append(description)
            yield

        return Hooks(progress=progress, warn=self.warnings.append)


def test_run_prints_nothing_and_announces_through_its_hooks(capfd):
    recorded = Recorded()
    report = run_use_case(RunRequest(CPU, texts=["Are you OK?"]), recorded.hooks())
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert len(recorded.progress) == 1
    assert recorded.progress[0].startswith("running the layer over 1 x ")
    assert recorded.warnings == []
    assert list(report.heads) == list(range(8))  # the default tables, not every head
    assert report.head_stats[0] == head_stats(report.trace)


def test_run_matches_what_the_cli_prints_as_json(invoke):
    options = ("Are you OK?", "--device", "cpu", "--heads", "4", "--d-model", "64")
    printed = json.loads(invoke("run", *options, "--json").stdout)
    request = RunRequest(
        LayerRequest({"device": "cpu", "heads": 4, "d_model": 64}),
        texts=["Are you OK?"],
        every_weight=True,
    )
    assert run_json(run_use_case(request)) == printed


def test_the_report_ranks_heads_and_windows_each_text():
    request = RunRequest(CPU, texts=["the cat eats fish", "a dog"], rows=["1:3"])
    report = run_use_case(request)
    strengths = [s.strength for s in report.ranked]
    assert strengths == sorted(strengths, reverse=True)
    assert sorted(map(id, report.ranked)) == sorted(map(id, report.head_stats[0]))
    for s in report.ranked:
        assert s.strength == max((getattr(s, p) or 0.0) for p in PATTERNS)
    short = report.windows[1]  # "a dog": fewer tokens than the longer text
    assert [row for _, row in short.computed] == [r for r in (1, 2) if r < short.queries]
    first = report.windows[0]
    assert first.hidden == [(0, 0), (3, first.queries - 1)]


def test_a_long_run_warns_through_the_hook(monkeypatch, capfd):
    monkeypatch.setattr(resources, "CEILING_PER_CPU_CORE", 1.0)  # time even a short run
    monkeypatch.setattr(resources, "measured_rates", lambda device, dtype: (1e3, 1e3))
    recorded = Recorded()
    run_use_case(RunRequest(CPU, texts=["Are you OK?"]), recorded.hooks())
    assert capfd.readouterr() == ("", "")
    assert len(recorded.warnings) == 1
    assert recorded.warnings[0].startswith("attnctl: this will take about ")


def test_shapes_is_the_plan_the_cli_prints(invoke):
    printed = json.loads(invoke("shapes", "--seq-len", "12", "--json").stdout)
    assert shapes_json(shapes_use_case(ShapesRequest(LayerRequest(), seq_len=12))) == printed


def test_memory_carries_its_variant_tables_and_fits(invoke):
    printed = json.loads(invoke("memory", "-L", "64,128", "--budget", "1GiB", "--json").stdout)
    report = memory_use_case(MemoryRequest(LayerRequest(), seq_len="64,128", budget="1GiB"))
    assert memory_json(report) == printed
    assert report.budget_bytes == 2**30
    for length in report.lengths:
        assert length.variants == variant_table(length.plan, length.estimate.layers)
        assert sum(length.bar_parts) == length.estimate.peak_bytes + length.kv_cache_bytes


def test_check_returns_its_result(capfd):
    recorded = Recorded()
    report = check_use_case(CheckRequest(CPU, seq_len=4, batch=1), recorded.hooks())
    assert capfd.readouterr() == ("", "")
    assert report.result.ok
    assert recorded.progress == ["comparing implementations and running gradcheck"]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (RunRequest(CPU), "give the text either as TEXT or with --file PATH"),
        (RunRequest(CPU, texts=["a"], digits=9), "--digits must be between 0 and 8"),
        (RunRequest(CPU, texts=["a"], block="0"), "--layer picks a block"),
        (MemoryRequest(CPU, seq_len="0"), "seq-len must be a positive integer"),
        (MemoryRequest(CPU, budget="1GiB", fit_device=True), "give --budget SIZE or --fit"),
    ],
)
def test_bad_requests_are_attnctl_errors(request_, message):
    use_case = run_use_case if isinstance(request_, RunRequest) else memory_use_case
    with pytest.raises(AttnctlError, match=message):
        use_case(request_)


def test_a_model_request_refuses_the_options_its_config_sets():
    with pytest.raises(AttnctlError, match=re.escape("--heads comes from the model's config.json")):
        resolve_layer(LayerRequest({"heads": 4}, model_dir="no-such-folder"))
