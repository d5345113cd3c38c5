"""How the Ascend gate reads BiSheng's output (ascend_gate.bisheng): the planned UB of a planned module,
the verdict of a run that stops at the absent hivmc, and the known-failure list. Pure text, so it runs in
the main venv; the gate itself (.ci/ascend_gate.sh) runs the real bishengir-compile."""

from __future__ import annotations

from pathlib import Path

from ascend_gate import bisheng

# Shaped as BiSheng 1.2.0 prints a planned module: constants, then buffers at their planned offsets.
PLANNED = """
  func.func @kernel(%arg0: memref<?xf32, #hivm.address_space<gm>>) {
    %c0_i64 = arith.constant 0 : i64
    %c16384_i64 = arith.constant 16384 : i64
    %c90272_i64 = arith.constant 90272 : i64
    %c123040_i64 = arith.constant 123040 : i64
    %0 = hivm.hir.pointer_cast(%c0_i64) : memref<1x4096xf32, #hivm.address_space<ub>>
    %1 = hivm.hir.pointer_cast(%c90272_i64, %c123040_i64) : memref<1x4096xf32, #hivm.address_space<ub>>
    %2 = hivm.hir.pointer_cast(%c16384_i64) : memref<64xi1, #hivm.address_space<ub>>
    %3 = hivm.hir.pointer_cast(%c123040_i64) : memref<512x512xf32, #hivm.address_space<cbuf>>
  }
"""
HIVMC_STOP = (
    "[ERROR] Cannot find hivmc under $PATH \n"
    'loc("kernel.mlir":1:1): error: External hivmc run fails, returning module before running external'
    " compiler\n[ERROR] Failed to run BiShengIR pipeline\n"
)
OVERFLOW = (
    "[NOTE] Ub overflow detected; automatically set enable-code-motion to false and retrying compilation.\n"
    "[NOTE] Ub overflow detected; automatically set enable-auto-multi-buffer to false and retrying"
    " compilation.\n"
    'loc("kernel.mlir":2:1): error: Failed to run BiShengHIR pipeline\n\n'
    'loc("kernel.mlir":3:3): error: ub overflow, requires 1971200 bits while 1572864 bits available!\n'
)


def test_planned_ub_is_the_end_of_the_highest_ub_buffer() -> None:
    # The second copy of the multibuffered buffer ends highest: 123040 + 4096 * 4; L1 (cbuf) is not UB.
    assert bisheng.planned_ub_bytes(PLANNED) == 123040 + 16384


def test_bits_round_up_to_bytes() -> None:
    module = (
        "%c8_i64 = arith.constant 8 : i64\n"
        "%0 = hivm.hir.pointer_cast(%c8_i64) : memref<3xi1, #hivm.address_space<ub>>"
    )
    assert bisheng.planned_ub_bytes(module) == 8 + 1


def test_a_run_that_stops_at_hivmc_passes_with_its_plan(tmp_path: Path) -> None:
    planned = tmp_path / "module.hivm.opt.mlir"
    planned.write_text(PLANNED)
    assert bisheng._verdict(HIVMC_STOP, 1, planned) == bisheng.Plan(None, 139424)


def test_an_overflow_fails_with_bishengs_message_and_the_ub_it_required(tmp_path: Path) -> None:
    plan = bisheng._verdict(OVERFLOW, 1, tmp_path / "absent.mlir")
    assert plan.error == "ub overflow, requires 1971200 bits while 1572864 bits available!"
    assert plan.ub_bytes == 1971200 // 8
    assert plan.dropped == ("code-motion", "auto-multi-buffer")


def test_an_abort_fails_with_its_llvm_error(tmp_path: Path) -> None:
    log = "LLVM ERROR: PlanMemory Traverse IR Failed! \nPLEASE submit a bug report\n #0 0x55"
    assert bisheng._verdict(log, -6, tmp_path / "absent.mlir").error == "PlanMemory Traverse IR Failed!"


def test_a_run_that_never_reaches_hivmc_fails_even_without_an_error(tmp_path: Path) -> None:
    plan = bisheng._verdict("Segmentation fault\n", -11, tmp_path / "absent.mlir")
    assert plan.error is not None and "exit -11" in plan.error and "Segmentation fault" in plan.error


def test_an_error_at_a_source_line_names_it_relative_to_the_repository(tmp_path: Path) -> None:
    source = Path.cwd() / "triton_kernels" / "indexer.py"
    log = (
        f'loc("{source}":348:0): error: Failed to run BiShengHIR pipeline\n'
        f"loc(\"{source}\":376:22): error: 'hivm.hir.store' op only support store ub to gm currently!\n"
    )
    plan = bisheng._verdict(log, 1, tmp_path / "absent.mlir")
    assert plan.where == "triton_kernels/indexer.py:376"
    assert plan.error == "'hivm.hir.store' op only support store ub to gm currently!"


def test_an_error_at_an_mlir_line_names_no_source(tmp_path: Path) -> None:
    log = (
        'loc("/tmp/x/kernel.ttadapter.mlir":3:3): error: ub overflow, requires 8 bits while 4 bits available!'
    )
    assert bisheng._verdict(log, 1, tmp_path / "absent.mlir").where is None
