import os
import tempfile

import pytest
import torch

# Kernel decisions are kept between processes in WFPASS_CACHE_DIR
# (wfpass/prepack/choose.py): the suite keeps its own, fresh each run, and its
# subprocesses inherit it, so no test reads a decision a developer's runs made.
os.environ["WFPASS_CACHE_DIR"] = tempfile.mkdtemp(prefix="wfpass-test-cache-")

# Under pytest-xdist (the README's command runs two workers) each worker is a
# process with torch's default of one thread per core: two workers on a
# 2-core machine would run four OpenMP threads spinning against each other.
# Each worker takes its share of the cores; the tests of multi-threaded
# kernels set their own thread counts.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


#: The suite's most expensive tests: each starts other Python programs (the
#: CLI, the benchmarks, the README's blocks, a second process reading a
#: cache) or compiles many graphs with Inductor, about 10 s or more apiece on
#: a 2-core CPU, 60% of the suite's time together. They carry the ``slow``
#: mark. CI runs every test on torch 2.13, then all but these on 2.11 and 2.15
#: (``-m "not slow"``; .ci/run): the three full suites do not fit CI's time
#: on such a machine. Tests whose subject changes between torch releases
#: (DDP, FSDP2, HF models, dynamic shapes through Dynamo, packed batches under
#: ``dynamic=True``) stay unmarked, so they run on every release. An entry is
#: a test function (all its cases) or one case.
SLOW = frozenset({
    "tests/batchnorm/test_batchnorm_report.py::test_graphs_compiled_are_inductor_s_plus_the_ones_the_rows_name",
    "tests/test_benchmarks.py::test_host_cost_benchmark_runs_quick_and_its_tables_add_up",
    "tests/test_benchmarks.py::test_pack_real_calls_benchmark_times_every_linear_in_both_variants",
    "tests/test_benchmarks.py::test_pass_time_benchmark_runs_and_checks_the_tree_it_imported",
    "tests/test_cli.py::test_bench_writes_its_table_figures_and_plot_each_variant_in_its_own_process",
    "tests/test_cli.py::test_demo_leads_with_measured_wins_checks_them_and_shows_zero_bytes",
    "tests/test_cli.py::test_every_bench_row_builds_and_wformat_rewrites_it_and_matches_eager",
    "tests/test_cli.py::test_wfpass_report_env_prints_at_exit_with_live_counters",
    "tests/core/test_compile_cache.py::test_a_second_process_reads_the_compiled_graphs_from_the_cache_and_another_wfpass_does_not",
    "tests/rnn/test_cxx_rnn.py::test_a_gru_compiled_with_dynamic_sizes_keeps_the_loop_at_each_size",
    "tests/batchnorm/test_fold_batchnorm.py::test_fold_every_inner_compiler_and_channel_count[inductor-alone]",
    "tests/batchnorm/test_fold_batchnorm.py::test_fold_every_inner_compiler_and_channel_count[inductor-with-linears-and-lstm]",
    "tests/batchnorm/test_fold_batchnorm.py::test_new_examples_take_the_inputs_symbols_not_fresh_ones[inductor]",
    "tests/rnn/test_fold_cells.py::test_inductor_bf16_and_training_steps_match_eager",
    "tests/test_formats.py::test_examples_run[channels_last_conv.py]",
    "tests/rnn/test_fuse_rnn.py::test_dynamic_lengths[inductor]",
    "tests/rnn/test_fuse_rnn.py::test_five_training_steps_equal_eager[inductor]",
    "tests/rnn/test_fuse_rnn.py::test_one_rnn_node_for_any_length",
    "tests/rnn/test_fuse_rnn.py::test_training_after_dynamic_recompile_stays_one_op_per_layer",
    "tests/rnn/test_fuse_rnn.py::test_zero_or_given_initial_state[lstm-proj]",
    "tests/core/test_lifecycle.py::test_rnn_and_batchnorm_formats_through_optimizer_clip_safetensors_and_non_strict_load",
    "tests/prepack/test_prepack.py::test_copies_die_with_their_model",
    "tests/prepack/test_prepack.py::test_decisions_are_kept_between_processes",
    "tests/prepack/test_prepack.py::test_the_python_kernel_alone_passes_the_change_tests",
    "tests/rnn/test_varlen_corners.py::test_allow_rnn_set_by_the_user_keeps_the_packed_rnn_in_the_graph",
    "tests/rnn/test_varlen_layer.py::test_the_aten_loop_gives_the_python_kernels_bits",
    "tests/rnn/test_varlen_memory.py::test_varied_training_rss_stays_near_eager",
    "tests/rnn/test_varlen_rnn.py::test_inductor_training_steps",
    "tests/core/test_properties.py::test_random_models_and_lives_match_eager",
    "tests/test_readme.py::test_readme_python_block_runs_as_written",
    "tests/deploy/test_export.py::test_the_cpp_example_runs_the_package_with_no_python",
    "tests/core/test_report.py::test_report_of_real_models_fits_120_and_80_columns_without_cutting_a_name[encodec]",
    "tests/core/test_report_truth.py::test_rows_add_up_to_the_calls_made_and_names_resolve",
    "tests/rnn/test_rnn_records.py::test_attention_decoder_cells_are_reported_not_folded",
    "tests/core/test_runtime.py::test_regional_compilation_fuses_each_layer_once[inductor]",
    "tests/core/test_runtime.py::test_rnn_residual_variants[proj]",
    "tests/core/test_runtime.py::test_twenty_models_compiled_and_deleted_leave_nothing_alive",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW or item.nodeid.split("[", 1)[0] in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Every test compiles the shared toy models anew; without a reset their
    # code objects hit Dynamo's recompile limit (8) across tests.
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
