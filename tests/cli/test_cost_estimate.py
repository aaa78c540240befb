"""The built-in price table covers the whole catalog, and `kinetic-prefect cost --estimate` prices a fallback list
before anything runs (pure logic, through the CLI; no server)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from kinetic_prefect import accelerators
from kinetic_prefect.cli import main
from kinetic_prefect.shared import cost, prices
from kinetic_prefect.shared.prices import NO_PUBLIC_PRICE, PRICES

pytestmark = pytest.mark.no_server

DOCS_COST = Path(__file__).resolve().parents[2] / "docs" / "cost.md"


def test_every_catalog_entry_has_a_price_or_says_why_not():
    assert set(PRICES) == set(accelerators.names())
    for name, price in PRICES.items():
        assert price.source and price.date, name
        if price.priced:
            assert price.on_demand is not None and price.spot is not None, name
            assert price.on_demand > 0 and price.spot > 0, name
        else:
            assert price.note.startswith(f"{NO_PUBLIC_PRICE}: "), name
            assert cost.price_for(accelerators.resolve(name)) is None, name  # metered unpriced, not at $0
    unpriced_families = {
        "TPU7x" if name.startswith("tpu7x") else re.sub(r"x\d+$", "", name)
        for name, price in PRICES.items()
        if not price.priced
    }
    assert unpriced_families == {"cpu", "a100-80gb", "b200", "gb200", "rtx-pro-6000", "TPU7x"}
    for family in unpriced_families:  # the module's docstring lists what has no price and why
        assert family in (prices.__doc__ or ""), family


def test_spot_is_never_above_on_demand():
    for name, price in PRICES.items():
        if price.priced:
            assert price.spot <= price.on_demand, name


def test_more_gpus_on_a_node_cost_more():
    families: dict[str, list[accelerators.AcceleratorSpec]] = {}
    for spec in accelerators.catalog():
        if spec.family == "gpu" and PRICES[spec.name].priced:
            families.setdefault(spec.gke_accelerator or "", []).append(spec)
    assert len(families) >= 7  # t4, p4, p100, v100, l4, a100, h100 (+ the single-size h100-mega, h200)
    for members in families.values():
        members.sort(key=lambda spec: spec.chips)
        for rate in ("on_demand", "spot"):
            figures = [getattr(PRICES[spec.name], rate) for spec in members]
            assert figures == sorted(figures) and len(set(figures)) == len(figures), (members[0].name, figures)
    assert PRICES["l4x8"].on_demand > PRICES["l4x4"].on_demand > PRICES["l4"].on_demand
    assert PRICES["a100x8"].on_demand > PRICES["a100x4"].on_demand > PRICES["a100"].on_demand


def test_tpus_are_priced_per_chip_and_a_slice_costs_all_its_chips():
    for spec in accelerators.catalog():
        if spec.family != "tpu":
            continue
        price = PRICES[spec.name]
        assert price.unit == "chip", spec.name
        if price.priced:
            job_rate = cost.host_rate(spec, price, False) * spec.hosts
            assert job_rate == pytest.approx(spec.chips * price.on_demand), spec.name
    multi_host = accelerators.resolve("tpu-v5p-64")  # 32 chips on 8 hosts
    assert multi_host.hosts == 8
    assert cost.host_rate(multi_host, PRICES["tpu-v5p-64"], True) * 8 == pytest.approx(32 * PRICES["tpu-v5p-8"].spot)


def test_the_docs_cost_page_shows_the_table_the_code_has():
    assert prices.markdown_table() in DOCS_COST.read_text()


# --------------------------------------------------------------------------- kinetic-prefect cost --estimate


def estimate_json(capsys, *args: str) -> list[dict]:
    assert main(["cost", "--estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["rows"]


def test_an_estimate_prices_each_entry_of_a_fallback_list(capsys):
    assert main(["cost", "--estimate", "tpu-v6e-8,a100x4,l4x4", "--minutes", "30"]) == 0
    out = capsys.readouterr().out
    assert out.index("tpu-v6e-8") < out.index("a100x4") < out.index("l4x4")  # the order the worker tries them
    assert "$10.8000" in out  # 8 chips x $2.7 for half an hour
    rows = estimate_json(capsys, "tpu-v6e-8,a100x4,l4x4", "--minutes", "30")
    assert [(r["accelerator"], r["hosts"], r["chips"]) for r in rows] == [
        ("tpu-v6e-8", 1, 8),
        ("a100x4", 1, 4),
        ("l4x4", 1, 4),
    ]
    assert rows[1]["on_demand_usd_per_hour"] == pytest.approx(PRICES["a100x4"].on_demand)
    assert rows[1]["spot_usd_per_hour"] == pytest.approx(PRICES["a100x4"].spot)
    assert rows[2]["usd"] == pytest.approx(PRICES["l4x4"].on_demand / 2)


def test_a_spot_entry_uses_the_spot_rate_and_an_unpriced_one_says_so(capsys):
    assert main(["cost", "--estimate", "l4:spot,b200x8", "--minutes", "90"]) == 0
    out = capsys.readouterr().out
    assert NO_PUBLIC_PRICE in out and "a4-highgpu-8g" in out  # why b200x8 has none
    spot, b200 = estimate_json(capsys, "l4:spot,b200x8", "--minutes", "90")
    assert spot["spot"] and spot["usd"] == pytest.approx(1.5 * PRICES["l4"].spot)
    assert b200["usd"] is None and b200["on_demand_usd_per_hour"] is None


def test_a_multi_host_slice_and_a_group_are_priced_for_every_host(capsys):
    (slice_row,) = estimate_json(capsys, "tpu-v6e-16", "--minutes", "60")
    assert (slice_row["hosts"], slice_row["chips"]) == (4, 16)
    assert slice_row["usd"] == pytest.approx(16 * PRICES["tpu-v6e-1"].on_demand)
    (group,) = estimate_json(capsys, "l4", "--minutes", "60", "--hosts", "2")
    assert group["hosts"] == 2 and group["usd"] == pytest.approx(2 * PRICES["l4"].on_demand)


def test_an_estimate_of_a_kinetic_task_reads_its_accelerators_and_hosts(capsys, tmp_path, monkeypatch):
    (tmp_path / "estimate_flows.py").write_text(
        textwrap.dedent(
            """
            from kinetic_prefect import kinetic_task

            @kinetic_task(accelerator=["a100x4", "l4x4:spot"], hosts=2)
            def train(epochs: int) -> int:
                return epochs

            def helper() -> None:
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = estimate_json(capsys, "estimate_flows:train", "--minutes", "60")
    assert [(r["accelerator"], r["hosts"], r["chips"]) for r in rows] == [("a100x4", 2, 8), ("l4x4:spot", 2, 8)]
    assert rows[1]["usd"] == pytest.approx(2 * PRICES["l4x4"].spot)
    assert main(["cost", "--estimate", "estimate_flows:helper", "--minutes", "5"]) == 1
    err = capsys.readouterr().err
    assert "'estimate_flows:helper' is not a @kinetic_task" in err and "estimate_flows:train" in err


@pytest.mark.parametrize(
    "args, culprit, fix",
    [
        (["--estimate", "l5", "--minutes", "5"], "Unknown accelerator 'l5'", "Closest valid names: l4"),
        (["--estimate", "l4,h9000", "--minutes", "5"], "'h9000'", "Closest valid names"),
        (["--estimate", "no_such_module:train", "--minutes", "5"], "cannot import 'no_such_module'", "sys.path"),
        (["--estimate", "l4", "--minutes", "0"], "--minutes 0", "more than 0"),
        (["--estimate", "l4", "--minutes", "-3"], "--minutes -3", "more than 0"),
        (["--minutes", "5"], "--estimate and --minutes go together", "--estimate l4,a100x4"),
    ],
)
def test_bad_estimate_input_names_the_culprit_and_the_fix(capsys, args, culprit, fix):
    assert main(["cost", *args]) == 1
    err = capsys.readouterr().err
    assert culprit in err and fix in err
