"""bench.ncu_digest: Nsight Compute's `--csv --page details` rows become one digest row a launch."""

from __future__ import annotations

import csv
import io

import pytest

from bench import ncu_digest
from bench.kernel_split import kernel_label

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size", "Grid Size",
          "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value", "Rule Name", "Rule Type",
          "Rule Description", "Estimated Speedup Type", "Estimated Speedup"]
WALK = "walk_kernel::delta_walk[v2,cw51cXTLSUwv1sDUaKthqa_3d_3d](long long, long long, Array<int, 1, C, mutable, aligned>)"
NVJET = "nvjet_sm90_tss_80x64_64x11_2x1_v_bz_TNN"


def _csv(launches: list[tuple[str, str, list[tuple]]]) -> str:
    """ncu's output: its own lines first, then one CSV row a metric or rule of each launch."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 601 (/usr/bin/python3.12)\nsome program output\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(HEADER)
    for i, (name, grid, rows) in enumerate(launches):
        for metric, unit, value, rule, description, speedup in rows:
            writer.writerow([i, 601, "python3.12", "127.0.0.1", name, 1, 7, "(256, 1, 1)", grid, 0, 9.0, "S", metric,
                             unit, value, rule, "", description, "", speedup])
    return out.getvalue()


def _metric(name: str, unit: str, value: str) -> tuple:
    return (name, unit, value, "", "", "")


TEXT = _csv([
    (WALK, "(2, 48, 1)", [
        _metric("Duration", "ns", "22,880"), _metric("Grid Size", "", "96"), _metric("Block Size", "", "256"),
        _metric("Issue Slots Busy", "%", "23.73"), _metric("Active Warps Per Scheduler", "warp", "2.00"),
        _metric("Eligible Warps Per Scheduler", "warp", "0.48"), _metric("Achieved Occupancy", "%", "12.71"),
        _metric("Theoretical Occupancy", "%", "12.50"), _metric("Block Limit Registers", "block", "1"),
        _metric("Block Limit Shared Mem", "block", "1"), _metric("Block Limit Warps", "block", "8"),
        _metric("Registers Per Thread", "register/thread", "255"),
        _metric("Dynamic Shared Memory Per Block", "byte/block", "175,616"),
        _metric("Local Memory Spilling Requests", "", "44,544"), _metric("DRAM Throughput", "%", "7.30"),
        _metric("Local Memory Spilling Request Overhead", "%", "no data"),
        ("", "", "", "HighPipeUtilization", "ALU is the highest-utilized pipeline (47.8%) based on elapsed cycles.", ""),
        ("", "", "", "TheoreticalOccupancy", "The 2.00 theoretical warps per scheduler are below 16.", "42.65"),
    ]),
    (NVJET, "(2, 32, 1)", [
        _metric("Duration", "us", "56.10"), _metric("Grid Size", "", "64"), _metric("DRAM Throughput", "%", "67.66"),
        ("", "", "", "SOLBottleneck", "This workload exhibits low compute throughput.", ""),
    ]),
])


def test_each_launch_becomes_one_row_with_its_metrics():
    walk, gemm = (ncu_digest.summary(k) for k in ncu_digest.parse(TEXT))
    assert walk == {"label": "walk_kernel.delta_walk", "grid": 96.0, "block": 256.0, "duration_us": pytest.approx(22.88),
                    "issue_busy": 23.73, "warps": 2.0, "eligible": 0.48, "occupancy": 12.71, "theoretical": 12.5,
                    "limit": "Registers/Shared Mem", "registers": 255.0, "shared_kb": 171.5, "spills": 44544.0,
                    "dram": 7.3, "pipe": "ALU 47.8%"}
    assert gemm["label"] == NVJET and gemm["duration_us"] == pytest.approx(56.1) and gemm["dram"] == 67.66
    assert gemm["limit"] is None and gemm["pipe"] is None and gemm["spills"] is None


def test_table_filters_by_label_and_lists_rules_that_estimate_a_speedup():
    kernels = ncu_digest.parse(TEXT)
    text = ncu_digest.table(kernels, pattern="delta_walk", rules=True)
    rows = text.splitlines()
    assert len(rows) == 4  # header, separator, the walk, its one rule with a speedup
    assert rows[2].startswith("| 0 | walk_kernel.delta_walk | 96 x 256 | 22.9 | 23.7 | 2.00 (0.48) | 12.7 (Registers/Shared Mem)")
    assert "44,544" in rows[2] and "ALU 47.8%" in rows[2]
    assert rows[3].startswith("|  | TheoreticalOccupancy (est. speedup 42.65%)")
    assert NVJET in ncu_digest.table(kernels) and "SOLBottleneck" not in ncu_digest.table(kernels, rules=True)


def test_number_reads_ncu_values():
    assert ncu_digest.number("3,196,213,729.65") == 3196213729.65
    assert [ncu_digest.number(v) for v in ("no data", "", "PolicySpread")] == [None, None, None]


def test_text_without_the_csv_header_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="--csv --page details"):
        ncu_digest.parse("==PROF== Disconnected\n")
    bad = tmp_path / "ncu.csv"
    bad.write_text("==ERROR== profiling failed\n")
    assert ncu_digest.main([str(bad)]) == 2
    assert "no ncu CSV header" in capsys.readouterr().err
    good = tmp_path / "good.csv"
    good.write_text(TEXT)
    assert ncu_digest.main([str(good), "--kernel", "nvjet"]) == 0
    assert "walk" not in capsys.readouterr().out


def test_kernel_label_cuts_ncu_and_cupti_names():
    assert kernel_label(WALK) == "walk_kernel.delta_walk"
    assert kernel_label("executor::numba_cuda::norms::_add_rms_norm_kernel[abi:v14](Array<float>)") == \
        "norms._add_rms_norm_kernel"
    assert kernel_label(NVJET) == NVJET
