"""``experiments/kernel_ptx_report.py``: what the device-free compile report reads from PTX
and from ``ptxas -v`` (the compile itself needs jax[cuda13] 0.11.2, ``.venv-ptx``, not CI's
stack; its figures for the first kernels are in ``experiments/results/kernel_ptx.md``)."""

from __future__ import annotations

from experiments import device_wheels, kernel_ptx
from experiments.kernel_ptx_report import COLUMNS, entry_ptx, ptx_counts, ptxas_resources, table

PTX = """.version 8.7
.target sm_90a
.visible .entry copejax_attention_forward(
    .param .u64 a
)
{
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 0;
    fma.rn.f32 %f2, %f3, %f4, %f5;
    fma.rn.ftz.f32 %f2, %f3, %f4, %f5;
}
.visible .entry copejax_attention_dq(
    .param .u64 a
)
{
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
}
"""

PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'copejax_attention_dq' for 'sm_90a'
ptxas info    : Function properties for copejax_attention_dq
    552 bytes stack frame, 572 bytes spill stores, 580 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 552 bytes cumulative stack size
ptxas info    : Compiling entry function 'copejax_attention_forward' for 'sm_90a'
ptxas info    : Function properties for copejax_attention_forward
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 167 registers, used 1 barriers
"""


def test_counts_the_matrix_instructions_and_fmas_of_one_entry() -> None:
    forward = entry_ptx(PTX, "copejax_attention_forward")
    assert forward.startswith(".visible .entry copejax_attention_forward(")
    assert "mma.sync" not in forward
    counts = ptx_counts(forward)
    assert (counts["wgmma"], counts["mma"], counts["fma_f32"]) == (1, 0, 2)
    assert ptx_counts(entry_ptx(PTX, "copejax_attention_dq"))["mma"] == 1
    assert entry_ptx(PTX, "copejax_attention_dkdv") == ""


def test_reads_registers_and_spills_of_the_named_entry() -> None:
    assert ptxas_resources(PTXAS, "copejax_attention_dq") == {
        "stack": 552,
        "spill_st": 572,
        "spill_ld": 580,
        "regs": 255,
    }
    assert ptxas_resources(PTXAS, "copejax_attention_forward")["regs"] == 167
    assert ptxas_resources(PTXAS, "copejax_attention_dkdv") == {}


def test_table_shows_missing_values_and_errors() -> None:
    rows = [
        {"kernel": "k", "num_warps": 4, "compile_s": 1.25, "regs": 200, "ptx_bytes": 2048},
        {"kernel": "slow", "num_warps": 4, "error": "compilation stopped after 600 s"},
    ]
    lines = table(rows).splitlines()
    assert lines[0].split() == [column for column, _ in COLUMNS]
    assert lines[1].split() == ["k", "4", "1.2", "200", "-", "-", "-", "-", "-", "2"]
    assert lines[2].split()[:3] == ["slow", "4", "-"]
    assert lines[3] == "  error: compilation stopped after 600 s"


def test_setup_installs_the_gpu_machines_jax_and_its_flax() -> None:
    assert "jax[cuda13]==0.11.2" in kernel_ptx.PACKAGES
    assert "flax==0.12.10" in kernel_ptx.PACKAGES
    assert kernel_ptx.TARGET.is_file() and "sm_9.0a" in kernel_ptx.TARGET.read_text()


def test_setup_installs_what_the_test_suite_needs_at_pinned_versions() -> None:
    """``.venv-ptx`` runs the tests on the device's jax: copejax's and the tests' packages from
    pyproject.toml (not the large torch and transformers, whose tests skip) and those the
    device image lacks, each at constraints.txt's version."""
    names = kernel_ptx.suite_packages()
    assert {"pytest", "pytest-xdist", "hypothesis", "grain", "matplotlib", "array-record"} <= set(
        names
    )
    assert not {"torch", "transformers", "ruff", "jax", "flax"} & set(names)
    assert len(names) == len(set(names))
    pinned = device_wheels.pins(names=names)
    constraints = (device_wheels.ROOT / "constraints.txt").read_text().split()
    assert pinned[-1] == "flax==0.12.10"  # the device's flax, then constraints.txt's pins
    assert all(p in constraints for p in pinned[:-1])
