# ruff: noqa: E501  (one row per line: adding a fault, or naming its test, is a one-line change)
"""The fault matrix: every fault keras-dp is tested against, what the test asserts, and which test.

``report.py`` turns the tests' junit XML into docs/reliability.md from these rows;
``test_matrix.py`` checks that every test named here exists and that the page lists these rows.

A row is ``Row(fault, backend, outcome, bound_s, tests)``:

- ``fault``: what happens, and to which process or replica;
- ``backend``: ``"torch"``, ``"jax"`` or ``"both"`` (dp_core code both backends run);
- ``outcome``: what the test asserts, in the user's words;
- ``bound_s``: the time bound the test asserts, in seconds, or None;
- ``tests``: one pytest node id or a tuple of them. ``path::test_name`` without ``[case]`` stands
  for every case of a parametrized test. ``PENDING`` marks a fault whose test is being written:
  such a row is not on the page, and the report refuses to write one while any row is pending,
  unless told ``--without-pending``.

Only the standard library here: noxfile.py reads this module to know which tests to run.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = {"torch": "torch_dp", "jax": "jax_dp", "both": "both (dp_core)"}
PENDING: tuple[str, ...] = ()


@dataclass(frozen=True)
class Row:
    fault: str
    backend: str
    outcome: str
    bound_s: float | None
    tests: str | tuple[str, ...]

    @property
    def node_ids(self) -> tuple[str, ...]:
        return (self.tests,) if isinstance(self.tests, str) else tuple(self.tests)

    @property
    def pending(self) -> bool:
        return not self.node_ids


# Test files, so that a row's node id fits on its line.
TORCH_FAULTS = "packages/torch_dp/tests/test_faults.py"
TORCH_INTERACTIVE = "packages/torch_dp/tests/test_interactive.py"
TORCH_CHECKPOINTS = "packages/torch_dp/tests/test_checkpoints.py"
TORCH_TWO_REPLICAS = "packages/torch_dp/tests/test_two_replicas.py"
JAX_FAULTS = "packages/jax_dp/tests/test_faults.py"
JAX_MULTIPROCESS = "packages/jax_dp/tests/test_multiprocess.py"
JAX_CHECKPOINTS = "packages/jax_dp/tests/test_checkpoints.py"
DAMAGE = "packages/core/tests/test_checkpoint_damage.py"
PREEMPTION = "packages/core/tests/test_preemption.py"
LISTENERS = "tests/network/test_listeners.py"
JAX_HANDSHAKE = "packages/jax_dp/tests/test_handshake.py"
JAX_STRANGERS = "packages/jax_dp/tests/test_strangers.py"
TORCH_SHARED = "packages/torch_dp/tests/test_shared_host.py"
CKPT_DIR = "packages/core/tests/test_checkpoint_dir.py"
TORCH_HOSTS = "tests/network/test_hosts_torch.py"  # hosts as network namespaces on a bridge (tests/network/hosts.py)
JAX_HOSTS = "tests/network/test_hosts_jax.py"
JAX_HOSTS_RESTART = "tests/network/test_hosts_jax_restart.py"  # reliability only: not in bare nox's lean part
SLURM_REQUEUE = "tests/network/test_hosts_slurm_requeue.py"  # reliability only: not in bare nox's lean part
RAY = "tests/ray/test_ray_train.py"  # a local Ray cluster: nox -s ray runs it too

CRAFTED = f"{DAMAGE}::test_crafted_newest_falls_back_to_the_previous_in_bounded_time_and_memory"
FALLS_BACK = "`latest_checkpoint` falls back to the previous checkpoint with a warning naming the file and the problem, within 2 s and 8 MB"


def crafted(*cases: str) -> tuple[str, ...]:
    return tuple(f"{CRAFTED}[{case}]" for case in cases)


# fmt: off
ROWS: tuple[Row, ...] = (
    # torch_dp: a replica fails
    Row("Replica 1 of 2 raises in the forward pass of a step", "torch", "`fit` raises `WorkerError` naming replica 1 of 2 with its traceback; no replica left running; the newest checkpoint verifies and is the last finished step", 60, f"{TORCH_FAULTS}::test_a_replica_failing_mid_step_stops_all_names_it_and_keeps_the_checkpoint[raise]"),
    Row("Replica 1 of 2 is SIGKILLed in the middle of a step", "torch", "`fit` raises `WorkerError` naming replica 1 of 2, killed by signal 9; no replica left running; the newest checkpoint verifies and is the last finished step", 60, f"{TORCH_FAULTS}::test_a_replica_failing_mid_step_stops_all_names_it_and_keeps_the_checkpoint[kill]"),
    Row("The model factory raises in replica 1 of 2", "torch", "`fit` raises `WorkerError` naming replica 1 of 2 with its traceback; the failed process is gone and the temporary files are removed", 90, f"{TORCH_TWO_REPLICAS}::test_a_failing_replica_stops_all_promptly_and_names_its_rank"),
    Row("Replica 1 of 3 is SIGKILLed during a call to a kept `Trainer`", "torch", "the call raises `WorkerError` naming replica 1 of 3, killed by signal 9 (noticed from the collective, not the timeout); the other worker is stopped; the next call starts new workers and gives Keras's answer", 30, f"{TORCH_INTERACTIVE}::test_a_killed_worker_tears_the_pool_down_and_the_next_call_works"),
    Row("An error in replica 1 of a kept `Trainer` (a NaN loss in its half of the batch)", "torch", "the caller gets `NonFiniteLossError` itself, naming epoch 0, step 1; the next call runs on new workers", None, f"{TORCH_INTERACTIVE}::test_a_worker_error_arrives_as_itself_and_the_next_call_starts_new_workers"),
    Row("Replica 1 of 2 is stopped (SIGSTOP) mid-`fit` (`collective_timeout=5`)", "torch", "`WorkerError` names replica 1 and its pid as stopped, after the collective timeout; the stopped process is killed, none is left", 15, f"{TORCH_FAULTS}::test_a_stopped_replica_is_named_within_the_collective_timeout_and_no_process_is_left"),
    Row("Replica 1 of 2 hangs in its forward pass (`collective_timeout=5`)", "torch", "`WorkerError` names replica 1 as the one that stopped responding, by the collectives it entered; no process left", None, f"{TORCH_FAULTS}::test_a_stuck_replica_is_named_by_the_collectives_it_entered"),
    # torch_dp: the caller is interrupted or killed
    Row("Ctrl-C in Jupyter: SIGINT to the caller only", "torch", "`KeyboardInterrupt` in the caller; no worker process and no temporary file left", 10, f"{TORCH_INTERACTIVE}::test_ctrl_c_or_a_killed_caller_leaves_no_process_and_no_file[caller-only]"),
    Row("Ctrl-C in a terminal: SIGINT to the caller's whole process group", "torch", "`KeyboardInterrupt` in the caller; no worker process and no temporary file left", 10, f"{TORCH_INTERACTIVE}::test_ctrl_c_or_a_killed_caller_leaves_no_process_and_no_file[terminal]"),
    Row("The caller is SIGKILLed while its replicas train", "torch", "the workers notice and end; no process and no temporary file left", 10, f"{TORCH_INTERACTIVE}::test_ctrl_c_or_a_killed_caller_leaves_no_process_and_no_file[caller-killed]"),
    Row("The caller is SIGKILLed while its first replica is still starting (importing)", "torch", "every replica ends (Linux's parent-death signal, set before Python starts); the next run removes the temporary files", 5, f"{TORCH_INTERACTIVE}::test_a_caller_killed_while_its_replicas_start_leaves_no_process_and_no_file"),
    Row("A caller killed outright left its temporary directory behind", "torch", "the next run removes the dead caller's directory and keeps a live caller's", None, f"{TORCH_INTERACTIVE}::test_directories_left_by_runs_killed_outright_are_removed_by_the_next"),
    # torch_dp: ports and the rendezvous
    Row("The rendezvous port (`MASTER_PORT`) is taken by another program, single host", "torch", "no warning, nothing to do: a single-host pool meets through a file and opens no store port; gloo listens on 127.0.0.1 only", None, f"{TORCH_FAULTS}::test_skip_leaves_the_step_out_on_every_replica_and_the_pool_needs_no_port"),
    Row("The `MASTER_PORT` torchrun gave is taken by another program", "torch", "`RuntimeError` naming `MASTER_PORT=127.0.0.1:port`, the port in use and `--master-port`; no process group left initialized", None, f"{TORCH_FAULTS}::test_a_busy_port_under_torchrun_is_a_clear_error"),
    Row("A foreign process joins a running pool's rendezvous as rank 1 of 2", "torch", "it never joins (no store port; gloo's ports do not answer as one): refused or ended after 12 s; the run's weights equal `model.fit`'s", 60, f"{TORCH_FAULTS}::test_a_foreign_process_cannot_join_the_pool_and_the_run_is_undisturbed"),
    Row("Two jobs (a kept `Trainer` in each of two processes) on one machine at once", "torch", "both train to `model.fit`'s weights; no process left", None, f"{TORCH_INTERACTIVE}::test_two_pools_in_two_processes_at_once_both_train_correctly"),
    Row("Rank 0 alone for 10 s in a callback (`rendezvous_timeout=5`)", "torch", "with `collective_timeout=60` the run equals `model.fit`; with `collective_timeout=3` `WorkerError` names the collective timeout within 25 s", None, f"{TORCH_FAULTS}::test_rank_0_alone_for_longer_than_the_rendezvous_timeout_is_bounded_by_the_collective_timeout"),
    # torch_dp: a shared host
    Row("Another local user probes a running single-host pool: its folder, its rendezvous file, a store client on every port its processes listen on", "torch", "the folder (0700) and the rendezvous file cannot be read and no port answers as a store; the run's weights and losses equal `model.fit`'s", None, f"{TORCH_SHARED}::test_another_user_reaches_nothing_of_the_pools_rendezvous_and_the_run_equals_keras"),
    Row("A job sharing the temporary directory from another pid namespace (two containers, one `/tmp`) removes stale pool folders", "torch", "a folder whose owner holds its lock is kept whatever its pid says (a real `unshare --pid` namespace, and a pid that is no process here); one whose lock is free is removed; a new folder is locked from the moment it appears", None, (f"{TORCH_SHARED}::test_a_folder_is_stale_only_when_its_lock_is_free_whatever_its_pid_says", f"{TORCH_SHARED}::test_a_live_folder_of_another_pid_namespace_is_kept", f"{TORCH_SHARED}::test_a_pools_folder_is_locked_from_the_moment_it_appears")),
    Row("A kept Trainer's shared arrays, then its whole folder, are removed by something else between calls", "torch", "the next calls write them again (for the folder, a `RuntimeWarning` names it and says something else removed it); the run equals `model.fit`", None, f"{TORCH_SHARED}::test_a_kept_trainer_whose_files_were_removed_writes_them_again"),
    Row("Replica 1 of 2 runs out of memory (numpy's `_ArrayMemoryError` in a layer's call)", "torch", "`WorkerError` (rank 1) whose first line says replica 1 of 2 ran out of memory, with `_ArrayMemoryError: Unable to allocate ...` and to lower global_batch_size", None, f"{TORCH_SHARED}::test_a_replica_out_of_memory_is_named_as_such"),
    Row("Replica 1 of 2 raises an exception whose class cannot be rebuilt in the caller (`__init__` needs two arguments)", "torch", "`WorkerError` (rank 1) whose first line is `torch_dp replica 1 of 2 failed: TwoPartError: left and right`, with its traceback", None, f"{TORCH_SHARED}::test_an_exception_that_cannot_be_rebuilt_arrives_by_its_type_and_message"),
    Row("A script calls `fit` at its top level, without the `__main__` guard", "torch", "exit code 1 with `WorkerError`: replica 1 of 2 ended while it started, naming the script, `if __name__ == \"__main__\":` and the troubleshooting anchor; no process or file left", 120, f"{TORCH_SHARED}::test_a_script_without_the_main_guard_is_told_to_add_it"),
    Row("The interpreter ends while `fit` runs in a daemon thread", "torch", "exit code 0, no traceback and no \"preempted\" on stderr; no process or file left", 5, f"{TORCH_SHARED}::test_the_interpreter_ending_under_a_fit_in_a_daemon_thread_is_quiet"),
    # torch_dp: non-finite losses
    Row("A NaN loss at epoch 0, step 2 (`on_nonfinite_loss=\"stop\"`)", "torch", "`NonFiniteLossError` naming epoch 0, step 2 and the `'skip'` option; the step is not applied: the weights equal the last checkpoint's", None, f"{TORCH_FAULTS}::test_a_nonfinite_loss_stops_training_naming_epoch_and_step"),
    Row("A NaN loss in replica 1's half of a batch (`on_nonfinite_loss=\"skip\"`)", "torch", "a warning names epoch 1, step 1; every replica leaves that step's update out: the weights equal a 1-replica run that skipped it", None, f"{TORCH_FAULTS}::test_skip_leaves_the_step_out_on_every_replica_and_the_pool_needs_no_port"),
    # torch_dp: preemption, kills and resume
    Row("SIGTERM to the caller of a 2-replica `fit` with `checkpoint_dir`", "torch", "every replica stops at one step; `Preempted` names it and the checkpoint of that step; no replica left; a rerun resumes to bitwise-equal weights", 5, f"{TORCH_CHECKPOINTS}::test_sigterm_stops_every_replica_at_a_step_with_a_checkpoint_and_a_rerun_resumes_bitwise"),
    Row("SIGUSR1 to worker replica 1 of a `fit` without `checkpoint_dir`", "torch", "the run stops; `Preempted` says a notice came to another replica and that no checkpoint_dir was given", 5, f"{TORCH_CHECKPOINTS}::test_sigusr1_to_a_worker_replica_stops_the_run_and_says_nothing_was_saved"),
    Row("The whole 2-replica run is SIGKILLed mid-epoch", "torch", "a rerun resumes from the newest checkpoint to bitwise-equal weights; resumed on 1 replica it continues the same data order", None, (f"{TORCH_CHECKPOINTS}::test_a_run_killed_mid_epoch_resumes_to_bitwise_equal_weights", f"{TORCH_CHECKPOINTS}::test_resuming_on_one_replica_continues_the_same_data_order")),
    Row("Rank 0 of a torchrun job SIGKILLs itself; torchrun restarts the job (`--max-restarts 1`)", "torch", "the restarted job resumes from the checkpoint to the weights of an uninterrupted run, bitwise", None, f"{TORCH_CHECKPOINTS}::test_torchrun_restarts_a_killed_replica_and_resumes_to_the_same_weights"),
    Row("The newest checkpoint's `arrays.npz` is truncated", "torch", "a warning names it as damaged and the run resumes from the previous one, to bitwise-equal weights", None, f"{TORCH_CHECKPOINTS}::test_checkpoint_contents_and_a_damaged_newest_falls_back_to_the_previous"),
    Row("`checkpoint_dir` holds a checkpoint of another architecture, seed or global batch", "torch", "`CheckpointError` in the caller before any replica starts, naming both values and what to pass", None, f"{TORCH_CHECKPOINTS}::test_another_architecture_seed_or_global_batch_is_a_clear_checkpoint_error"),
    # jax_dp: a process of a 2-process run fails
    Row("Process 1 of 2 raises while reading a step's rows", "jax", "both exit with status 1; process 0's log names process 1 of 2 and its error; no process left; the newest checkpoint verifies and predates the failure", 5, f"{JAX_FAULTS}::test_a_failed_process_ends_the_run_within_the_bound[1-raise]"),
    Row("Process 0 of 2 (the coordinator) raises while reading a step's rows", "jax", "both exit with status 1; process 1's log names process 0 of 2 and its error; no process left; the newest checkpoint verifies and predates the failure", 5, f"{JAX_FAULTS}::test_a_failed_process_ends_the_run_within_the_bound[0-raise]"),
    Row("Process 1 of 2 is SIGKILLed (`timeout=10`)", "jax", "process 0 exits non-zero; jax names process 1 as the one that stopped sending heartbeats; no process left; the newest checkpoint verifies", 15, f"{JAX_FAULTS}::test_a_failed_process_ends_the_run_within_the_bound[1-kill]"),
    Row("Process 0 of 2 (the coordinator) is SIGKILLed (`timeout=10`)", "jax", "process 1 exits non-zero: jax says the leader task died; no process left; the newest checkpoint verifies", 15, f"{JAX_FAULTS}::test_a_failed_process_ends_the_run_within_the_bound[0-kill]"),
    Row("Process 1 of 2 raises and the script catches the error", "jax", "both processes end with status 1; process 0 names process 1; the failed process's next `fit` is refused", 5, f"{JAX_FAULTS}::test_an_error_the_script_catches_still_ends_the_run_fast[1]"),
    Row("Process 0 of 2 raises and the script catches the error", "jax", "both processes end with status 1; process 1 names process 0; the failed process's next `fit` is refused", 5, f"{JAX_FAULTS}::test_an_error_the_script_catches_still_ends_the_run_fast[0]"),
    Row("The coordinator's port is taken by another program", "jax", "`jax_dp.initialize` fails at once with status 1, naming the address and saying to pass a free port", 60, f"{JAX_FAULTS}::test_a_busy_coordinator_port_is_a_clear_error"),
    Row("A process claiming to be process 1 connects to a running job's coordinator", "jax", "it stops with \"held by a job that already started\" before reaching jax's coordinator; the running job finishes with the right weights", 5, f"{JAX_MULTIPROCESS}::test_a_latecomer_gets_a_clear_error_and_the_running_job_finishes_right"),
    Row("Two processes of different jobs (`job_id`) meet at one coordinator address at start-up", "jax", "process 0 refuses the other job's process, naming both job ids; neither joins jax's coordinator", None, f"{JAX_MULTIPROCESS}::test_processes_given_different_job_ids_are_refused_at_start_up"),
    # jax_dp: preemption, kills and resume
    Row("SIGTERM to process 1 of 2 with `checkpoint_dir`", "jax", "both processes stop at the same step with `Preempted` and status 1; process 0 writes that step's checkpoint", 5, f"{JAX_FAULTS}::test_sigterm_to_one_process_stops_both_at_one_step_with_a_checkpoint[1]"),
    Row("SIGTERM to process 0 of 2 with `checkpoint_dir`", "jax", "both processes stop at the same step with `Preempted` and status 1; process 0 writes that step's checkpoint", 5, f"{JAX_FAULTS}::test_sigterm_to_one_process_stops_both_at_one_step_with_a_checkpoint[0]"),
    Row("SIGTERM or SIGUSR1 to a 1-process, 4-device `fit` with `checkpoint_dir`", "jax", "the run stops at a step with `Preempted` naming the signal and the checkpoint of that step; a rerun resumes to bitwise-equal weights", 5, f"{JAX_CHECKPOINTS}::test_a_preemption_notice_stops_at_a_step_with_a_checkpoint_and_a_rerun_resumes_bitwise"),
    Row("SIGTERM to process 0 or 1 of 2 without `checkpoint_dir`", "jax", "both processes stop at the same step with `Preempted` saying nothing was saved and to pass `checkpoint_dir`; status 1; no directory written", 5, f"{JAX_FAULTS}::test_sigterm_to_one_process_without_checkpoint_dir_stops_both_at_one_step_saying_nothing_was_saved"),
    Row("A 2-device run is SIGKILLed mid-epoch", "jax", "a rerun resumes from the newest checkpoint to bitwise-equal weights; resumed on 4 replicas it continues the same data order", None, (f"{JAX_CHECKPOINTS}::test_a_run_killed_mid_epoch_resumes_to_bitwise_equal_weights", f"{JAX_CHECKPOINTS}::test_resuming_on_four_replicas_continues_the_same_data_order")),
    Row("Process 1's own `checkpoint_dir` is empty (a directory per host; only process 0 writes)", "jax", "every process resumes from process 0's checkpoint, with its History", None, f"{JAX_MULTIPROCESS}::test_every_process_resumes_from_process_0s_checkpoint_even_with_a_directory_of_its_own"),
    Row("`checkpoint_dir` holds a checkpoint written with another seed", "jax", "`CheckpointError` naming both seeds and what to pass", None, f"{JAX_CHECKPOINTS}::test_resume_with_another_seed_is_refused"),
    # dp_core: checkpoints damaged or crafted (read by both backends' resume)
    Row("`manifest.json` or `state.json` of the newest checkpoint is a FIFO", "both", FALLS_BACK, 2, crafted("manifest_is_a_fifo", "state_is_a_fifo")),
    Row("`manifest.json` or `arrays.npz` is a symbolic link to /dev/zero", "both", FALLS_BACK, 2, crafted("manifest_links_to_dev_zero", "arrays_link_to_dev_zero")),
    Row("`arrays.npz` is a symbolic link to another checkpoint's, or a directory", "both", FALLS_BACK, 2, crafted("arrays_link_to_another_checkpoints", "arrays_is_a_directory")),
    Row("A zip bomb: 256 MiB of zeros deflated to 260 KB, the manifest resealed", "both", FALLS_BACK, 2, crafted("zip_bomb")),
    Row("An array whose zip and .npy headers claim 1 GiB, or flagged encrypted", "both", FALLS_BACK, 2, crafted("member_claims_a_gigabyte", "encrypted_member")),
    Row("An array of shape (10^12,), resealed, in a new or an old manifest", "both", FALLS_BACK, 2, crafted("shape_1e12", "shape_1e12_in_an_old_manifest")),
    Row("A 17 MB `manifest.json` or `state.json`, or `state.json` nested 200,000 deep", "both", FALLS_BACK, 2, crafted("manifest_of_17_mb", "state_of_17_mb", "state_nested_200000_deep")),
    Row("`state.json` resealed with odd content: a list, keys missing or unknown, counts of 10^12, epoch a string, another step", "both", FALLS_BACK, 2, crafted("state_is_a_list", "missing_counts", "unknown_state_key", "counts_of_1e12", "epoch_is_a_string", "state_of_another_step")),
    Row("`arrays.npz` resealed with an array extra, missing, of object or string dtype, or of another shape", "both", FALLS_BACK, 2, crafted("extra_array", "missing_array", "object_array", "string_array", "shape_differs_from_the_manifest")),
    Row("A manifest that lists no files, or gives a wrong size", "both", FALLS_BACK, 2, crafted("empty_files_in_the_manifest", "size_differs_from_the_manifest")),
    Row("The newest checkpoint's name is a symbolic link to a valid checkpoint elsewhere, or a plain file", "both", "it is ignored with a warning saying what it is; the previous checkpoint is used, within 2 s and 8 MB", 2, f"{DAMAGE}::test_a_newest_entry_that_is_not_a_real_directory_is_ignored"),
    Row("Every checkpoint in `checkpoint_dir` is damaged", "both", "a warning says all are damaged and training starts from the beginning, within 2 s and 8 MB", 2, f"{DAMAGE}::test_when_every_checkpoint_is_damaged_training_starts_fresh_with_a_warning"),
    Row("`load_checkpoint` is given a symbolic link to a checkpoint", "both", "`CheckpointError`: it is a symbolic link, not a checkpoint directory", 2, f"{DAMAGE}::test_a_checkpoint_reached_through_a_symlink_is_refused"),
    Row("A checkpoint's name is taken by a symbolic link (to a directory, a file, nowhere) or a plain file", "both", "a rerun resumes from the previous checkpoint; the next save replaces the entry with a warning and leaves what it pointed at untouched", None, f"{DAMAGE}::test_saving_over_a_bad_entry_replaces_the_entry_not_its_target"),
    Row("A symbolic link that sorts after every checkpoint sits in `checkpoint_dir`", "both", "pruning keeps the 3 newest real checkpoints and never follows or removes the link", None, f"{DAMAGE}::test_pruning_keeps_real_checkpoints_and_never_follows_a_symlink"),
    Row("Damaged checkpoints of a later step are left by an earlier run", "both", "a fresh run starts from the beginning and its own checkpoints are not pruned in their favour", None, f"{DAMAGE}::test_a_fresh_run_is_not_pruned_by_newer_damaged_checkpoints"),
    Row("A writer was killed during a save, leaving a staging directory", "both", "the next save removes the stale staging directory and keeps one being written now", None, f"{DAMAGE}::test_stale_staging_directories_are_removed_by_the_next_save"),
    Row("The disk fills up while the arrays or the manifest are written", "both", "`OSError` (ENOSPC) saying the partial checkpoint was removed and the earlier ones are intact, and to free disk space; they load unchanged", None, f"{DAMAGE}::test_a_full_disk_removes_the_partial_checkpoint_and_keeps_the_previous_ones"),
    # dp_core: preemption notices
    Row("SIGTERM or SIGUSR1 during a run", "both", "the notice is recorded instead of ending the process; a second notice gets the usual handling; the previous handler comes back", None, f"{PREEMPTION}::test_a_notice_is_recorded_and_the_previous_handler_comes_back"),
    Row("A notice arrives after the last step", "both", "the notice is passed on to the previous handler when the run ends", None, f"{PREEMPTION}::test_a_notice_the_run_did_not_act_on_is_sent_again_when_it_ends"),
    Row("A notice arrives, then another error ends the run first", "both", "the error is raised with a note that the notice was not acted on, instead of the process ending before the error is printed", None, f"{PREEMPTION}::test_an_error_that_overtook_a_notice_is_raised_with_a_note_instead_of_the_process_ending"),
    # jax_dp: strangers on a shared host or network
    Row("Another local user's process 1 (no job id, like the job's) reaches a single-host job's waiting process 0", "jax", "it cannot read the generated secret (PermissionError) and stops with status 1 saying that process 0 belongs to another user; process 0 keeps waiting and admits its own process 1", None, f"{JAX_STRANGERS}::test_another_user_can_neither_read_the_generated_secret_nor_join"),
    Row("A same-user process with another job's secret joins first; then another user's plain `jax.distributed.initialize` as process 1 reaches the running job", "jax", "the first is refused (process 0 does not hold its secret; process 0 logs it); the second cannot reach jax's coordinator (Unix socket in a 0700 folder) and fails; the job keeps running and ends with the right weights, leaving no socket", None, f"{JAX_STRANGERS}::test_strangers_neither_join_nor_stop_a_running_job_that_trains_right"),
    Row("A stranger sends process 0 a 3 KB '['*3000 line, a 900-deep array, non-UTF-8 bytes or HTTP", "jax", "each connection is dropped without an answer; process 0 admits the real process 1", None, f"{JAX_HANDSHAKE}::test_a_stranger_s_malformed_line_is_ignored_and_the_job_forms"),
    Row("A stranger connects first and trickles one byte every 3 s", "jax", "the real process 1 is admitted within 2 s; process 0 drops the stranger at its 5 s deadline", 2, f"{JAX_HANDSHAKE}::test_a_stranger_trickling_bytes_delays_no_one"),
    Row("A process with another secret, a reflected proof or a replayed proof tries to join", "jax", "refused; the joiner is told process 0 does not hold its secret, process 0 logs each refusal; the real process joins", None, (f"{JAX_HANDSHAKE}::test_a_process_without_the_job_s_secret_is_refused_and_the_real_one_joins", f"{JAX_HANDSHAKE}::test_neither_a_reflected_nor_a_replayed_proof_passes")),
    Row("Two processes claim process 1 of a single-host job with a generated secret (two jobs of one user on one port)", "jax", "process 0 admits neither, raising with the cause and the line that sets a secret; both claimants are refused with it", None, f"{JAX_HANDSHAKE}::test_with_a_generated_secret_a_place_claimed_twice_stops_the_job"),
    Row("After a single-host job formed: a second process 0 on its port, a latecomer with the secret, one without", "jax", "the second process 0 fails at once (port in use); the latecomer is told the job already started (with a generated secret: that the job stops, and the job is ended); the one without is told process 0 does not hold its secret; once closed, the port is free and the secret file gone", None, f"{JAX_HANDSHAKE}::test_once_formed_a_single_host_job_keeps_its_port_and_refuses_latecomers"),
    Row("`jax_dp.initialize` on a coordinator other hosts reach without `KERAS_DP_JOB_SECRET`, or with one too short", "jax", "refused within 1 s in process 0 and process 1, with the line that sets one", 1, f"{JAX_HANDSHAKE}::test_a_coordinator_other_hosts_reach_needs_the_job_s_secret"),
    Row("`KERAS_DP_JOB_SECRET` set but empty or shorter than 16 characters", "both", "`ValueError` naming the length and the line that sets one; that line sets a 32-hex-digit secret", None, ("packages/core/tests/test_secret.py::test_a_secret_set_but_too_short_is_an_error_naming_the_line_that_sets_one", "packages/core/tests/test_secret.py::test_the_line_that_sets_one_sets_one")),
    # a checkpoint folder: one writer, readable versions, checked first
    Row("A second writer claims a `checkpoint_dir` another process holds; then the holder is SIGKILLed", "both", "`CheckpointDirInUseError` names the holder's pid and host, another checkpoint_dir and `kill <pid>`; the check before a fit says so too; once the holder dies the folder is free and the lock file is emptied on release", None, f"{CKPT_DIR}::test_a_second_writer_is_refused_naming_the_holder_until_the_holder_dies"),
    Row("A claim's block raises; another thread claims the same folder meanwhile", "both", "the other thread is refused naming this process; after the error the folder is free again", None, f"{CKPT_DIR}::test_the_claim_ends_with_its_block_even_on_error_and_binds_one_thread"),
    Row("Another host's run overwrites the lock record (a filesystem without shared locks)", "both", "the next save raises `CheckpointDirInUseError` naming that host and pid; nothing written or pruned; their record left alone", None, f"{CKPT_DIR}::test_a_run_whose_lock_record_was_taken_over_stops_before_writing_or_pruning"),
    Row("A writer saves and prunes (`keep=1`, every fourth save rewriting the same step) while a reader reads for 4 s", "both", "every `latest_checkpoint` and `list_checkpoints` finds a checkpoint once one exists", None, f"{CKPT_DIR}::test_a_reader_never_sees_the_folder_empty_while_a_writer_prunes"),
    Row("`checkpoint_dir` holds checkpoints of format version 2 (a newer keras-dp's)", "both", "`CheckpointVersionError` naming versions 2 and 1 and the upgrade; listed, never pruned or overwritten, also behind a readable one", None, f"{CKPT_DIR}::test_a_newer_format_is_refused_naming_both_versions_and_never_pruned"),
    Row("A manifest's `format_version` is 0, `\"2\"` or `true`", "both", "damage: a warning naming it, and the previous checkpoint is used", None, f"{CKPT_DIR}::test_an_older_or_crafted_version_is_still_damage_and_skipped"),
    Row("`checkpoint_dir` is a regular file, or lies under one", "both", "`CheckpointDirError` naming the path and the file in the way, from the check, the listing and the claim; the file untouched", None, f"{CKPT_DIR}::test_a_checkpoint_dir_that_is_or_is_under_a_file_is_refused_naming_it"),
    Row("`checkpoint_dir` is not writable for the user that would write (run as `nobody`)", "both", "`CheckpointDirError` naming the path, 'Permission denied' and the user, for an existing folder and one to be created; no probe file left", None, f"{CKPT_DIR}::test_an_unwritable_checkpoint_dir_is_refused_for_the_user_that_would_write"),
    Row("A 2-replica `fit` on a `checkpoint_dir` another process holds", "torch", "`CheckpointDirInUseError` naming the holder's pid, before the first step; the folder's checkpoint not restored, nothing written; after the holder dies a fit resumes and releases the lock", None, f"{TORCH_CHECKPOINTS}::test_a_checkpoint_dir_another_run_holds_stops_every_replica_before_the_first_step"),
    Row("`fit(epochs=6)` on three checkpoints of format version 2", "torch", "`CheckpointVersionError` naming both versions and the upgrade, before the first step; none pruned or added; weights unchanged", None, f"{TORCH_CHECKPOINTS}::test_checkpoints_of_a_newer_format_stop_fit_before_it_starts_and_are_never_pruned"),
    Row("`fit` with a `checkpoint_dir` that is a file or lies under one", "torch", "`CheckpointDirError` naming the path and 'is a regular file', before the first step", None, f"{TORCH_CHECKPOINTS}::test_a_checkpoint_dir_that_is_or_is_under_a_file_is_refused_before_anything_starts"),
    Row("A `fit` on a `checkpoint_dir` another process holds", "jax", "`CheckpointDirInUseError` naming the holder's pid, before anything is restored or stepped; weights unchanged; after the holder dies a fit resumes and releases the lock", None, f"{JAX_CHECKPOINTS}::test_a_checkpoint_dir_another_run_holds_is_refused_before_anything_is_restored"),
    Row("`fit(epochs=6)` on three checkpoints of format version 2", "jax", "`CheckpointVersionError` naming both versions and the upgrade, before the first step; none pruned or added; weights unchanged", None, f"{JAX_CHECKPOINTS}::test_checkpoints_of_a_newer_format_stop_fit_before_it_starts_and_are_never_pruned"),
    Row("`fit` with a `checkpoint_dir` that is a file or lies under one", "jax", "`CheckpointDirError` naming the path and 'is a regular file', before the first step", None, f"{JAX_CHECKPOINTS}::test_a_checkpoint_dir_that_is_or_is_under_a_file_is_refused_before_anything_starts"),
    # a call while another runs
    Row("`fit`, `evaluate`, `predict` or `close` is called from a callback of a running `fit` on the same Trainer", "torch", "each is refused at once with `dp_core.TrainerBusy` naming the running call, the refused one and that it came from a callback; the running fit goes on and equals `model.fit`", 5.0, "packages/torch_dp/tests/test_one_call.py::test_calls_from_a_callback_are_refused_at_once_and_the_running_fit_goes_on"),
    Row("A callback calls the Trainer and does not catch the refusal", "torch", "`fit` raises `dp_core.TrainerBusy` (no collective times out) and the next `fit` equals `model.fit`", 60.0, "packages/torch_dp/tests/test_one_call.py::test_an_uncaught_refusal_ends_the_fit_at_once_and_frees_the_trainer"),
    Row("Two threads call `fit` on one Trainer at once", "torch", "one runs and equals `model.fit`; the other gets `dp_core.TrainerBusy` naming both threads, its model untouched; the Trainer works afterwards", 5.0, "packages/torch_dp/tests/test_one_call.py::test_two_threads_one_fits_as_model_fit_and_the_other_is_refused_at_once"),
    Row("A callback of a running `fit` calls a second Trainer of 2 replicas in the same process", "torch", "refused at once with `dp_core.TrainerBusy` naming the other Trainer's running call, instead of stopping the running call's replicas; a 1-replica Trainer still runs", 5.0, "packages/torch_dp/tests/test_one_call.py::test_another_trainers_call_from_a_callback_is_refused_but_one_replica_runs"),
    Row("`fit`, `evaluate` or `predict` is called from a callback of a running `fit` on the same Trainer", "jax", "each is refused at once with `dp_core.TrainerBusy`, recorded as no failure of the run; the running fit equals `model.fit`", 5.0, "packages/jax_dp/tests/test_one_call.py::test_calls_from_a_callback_are_refused_at_once_and_the_running_fit_goes_on"),
    Row("A callback calls the Trainer and does not catch the refusal", "jax", "`fit` raises `dp_core.TrainerBusy` and the next `fit` equals `model.fit`", None, "packages/jax_dp/tests/test_one_call.py::test_an_uncaught_refusal_ends_the_fit_and_frees_the_trainer"),
    Row("Two threads call `fit` on one Trainer at once", "jax", "one runs and equals `model.fit`; the other gets `dp_core.TrainerBusy` at once, its model untouched; the Trainer works afterwards", 5.0, "packages/jax_dp/tests/test_one_call.py::test_two_threads_one_fits_as_model_fit_and_the_other_is_refused_at_once"),
    Row("A Trainer call ends by return, exception, KeyboardInterrupt or Preempted", "both", "the one-call guard is released and the next call runs", None, "packages/core/tests/test_one_call.py::test_every_way_out_of_a_call_frees_the_trainer"),
    # the network
    Row("A host on the network tries to reach a single-host `torch_dp` run", "torch", "the caller and its replicas listen on loopback only (gloo; the rendezvous is a file)", None, f"{LISTENERS}::test_torch_dp_replicas_listen_on_loopback_only"),
    Row("Host 2 of a 2-host job (SLURM's variables, one rank a host) dies mid-`fit`: every process on it SIGKILLed (`collective_timeout=10`)", "torch", "rank 0 on host1 exits with `WorkerError` naming rank 1 of 2 on host2 and its address, not the Keras layer whose collective broke (BatchNormalization's)", 25, f"{TORCH_HOSTS}::test_a_lost_host_is_named_by_rank_and_host[killed]"),
    Row("The link of host 2 of a 2-host job goes down mid-`fit` (`collective_timeout=10`)", "torch", "both ranks exit with `WorkerError` naming the rank and host they waited for (rank 1 on host2, rank 0 on host1), within the collective timeout", 25, f"{TORCH_HOSTS}::test_a_lost_host_is_named_by_rank_and_host[cut-off]"),
    Row("Each of 2 hosts resolves its own name to 127.0.1.1 (Debian's `/etc/hosts` line)", "torch", "each rank warns and has gloo use the interface that reaches the other host; the run equals `model.fit` (before: the group never formed)", None, f"{TORCH_HOSTS}::test_a_hostname_that_resolves_to_loopback_is_routed_around"),
    Row("Two hosts cloned from one image: one hostname, resolving to 127.0.1.1 on both (`rendezvous_timeout=10`)", "torch", "the group cannot form: both ranks exit with status 1 within 20 s, naming `rendezvous_timeout=10 s`, each rank's host and address and `GLOO_SOCKET_IFNAME` (before: one rank waited 50 s in gloo)", 20, f"{TORCH_HOSTS}::test_a_group_that_cannot_form_ends_every_rank_within_the_rendezvous_timeout"),
    Row("A job of 2 hosts x 2 processes under torchrun (4 replicas: gloo within each host and between them)", "torch", "the run equals `model.fit`'s weights; every process of host 1 trains as one of 4 replicas", None, f"{TORCH_HOSTS}::test_torchrun_2x2_trains_as_model_fit"),
    Row("Host 2 of an elastic torchrun job (`--nnodes=1:2 --max-restarts=3`, a checkpoint a step in each host's own folder) dies mid-`fit`, then starts again", "torch", "rank 0 names rank 1 on host2; torchrun re-forms the job on host 1 alone and `fit` resumes from rank 0's checkpoint on 1 replica; host 2 back, torchrun stops host 1 at a step (SIGTERM: `Preempted`, a checkpoint), re-forms on both hosts and `fit` resumes on 2 replicas, ending within 1e-5 of `model.fit` (with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: with torch 2.13's shared store the rejoin never formed)", None, f"{TORCH_HOSTS}::test_a_job_that_loses_a_host_carries_on_under_elastic_torchrun_and_the_host_rejoins"),
    Row("The link between the 2 hosts of a torchrun 2x1 job holds every packet 20 ms each way: a 40 ms round trip (a userspace relay, `tests/network/delay.py`; this kernel has no `tc netem`)", "torch", "the run equals `model.fit`'s weights, as on the bridge; a step takes a round trip at least (Measured: the median step through the delay; 140 ms against 9.3 ms on the bridge, 15x, on 2 busy cores on 2026-12-06)", None, f"{TORCH_HOSTS}::test_a_slow_link_slows_steps_and_changes_nothing"),
    Row("A plain `jax.distributed.initialize` connects to a 2-host job's coordinator port while process 0 admits, and another once the job runs", "jax", "both are dropped: process 0 keeps the port, and jax's coordination service is on a port only admitted processes learn; the job's weights equal `model.fit`'s (before: both job processes aborted)", None, f"{JAX_HOSTS}::test_two_hosts_train_as_model_fit_and_strangers_on_the_port_change_nothing"),
    Row("Process 1's host of a 2-host job dies mid-`fit`: every process on it SIGKILLed (`timeout=10`)", "jax", "process 0 exits non-zero naming process 1 of 2 on host2 (before: gloo's bare 'connection reset' `ValueError`)", 25, f"{JAX_HOSTS}::test_a_killed_process_is_named_by_process_and_host"),
    Row("Each of 2 hosts resolves its own name to 127.0.1.1, the coordinator given by address", "jax", "each process stops right after joining, naming its host and the `/etc/hosts` line to change (before: a raw gloo error once `fit` ran)", 30, f"{JAX_HOSTS}::test_a_hostname_that_resolves_to_loopback_fails_at_once_saying_what_to_change"),
    Row("Host 2 of a 2-host `jax_dp` job (a checkpoint a step, process 0's folder on host 1) dies mid-`fit`; the restart loop of docs/multi-host.md runs the job again on the host left (1 process)", "jax", "process 0 ends naming process 1 of 2 on host2; the rerun resumes from process 0's newest checkpoint on 1 replica, trains only the steps after it, and ends within 1e-5 of `model.fit`", None, f"{JAX_HOSTS_RESTART}::test_a_job_that_loses_a_host_resumes_on_the_hosts_left_under_a_restart_loop"),
    Row("Host 2 of a 2-task SLURM job (`#SBATCH --requeue`; SLURM's variables set by hand, a checkpoint a step in a folder every host sees) dies mid-`fit`; SLURM requeues the job on host 1 and host 3 (the same job id, `SLURM_RESTART_COUNT=1`)", "torch", "rank 0 on host1 ends naming rank 1 of 2 on host2; the requeued job forms on the port its job id gives, resumes from rank 0's newest checkpoint, trains only the steps after it, and ends bitwise equal to the job run uninterrupted on 2 tasks, within 1e-5 of `model.fit`", None, f"{SLURM_REQUEUE}::test_a_requeued_job_resumes_from_rank_0s_checkpoint_on_the_nodes_it_gets"),
    Row("Ray Train with `FailureConfig(max_failures=1)`: the process of worker 1 of 2 is SIGKILLed mid-`fit` (a checkpoint a step)", "torch", "Ray runs the training function again on 2 new workers; `fit` resumes from rank 0's newest checkpoint, trains only the steps after it, and ends bitwise equal to the uninterrupted run, within 1e-5 of `model.fit`", None, f"{RAY}::test_a_worker_killed_mid_fit_is_restarted_by_ray_and_fit_resumes_from_its_checkpoint"),
    Row("A host on the network tries to reach a single-host, 2-process `jax_dp` run", "jax", "every process listens on loopback only; process 0 holds the port it was given, and jax's coordinator is on a Unix socket", None, f"{LISTENERS}::test_jax_dp_processes_listen_on_loopback_only"),
)
# fmt: on

# Where each group of tests runs: the folder its node ids start with, and the Keras backend.
GROUPS = {
    "core": ("packages/core/tests/", "jax"),
    "network": ("tests/network/", "jax"),
    "torch": ("packages/torch_dp/tests/", "torch"),
    "jax": ("packages/jax_dp/tests/", "jax"),
    "ray": ("tests/ray/", "torch"),  # needs ray[train] in the session
}


def node_ids_by_group() -> dict[str, list[str]]:
    """The node ids of every row that is not pending, by the group that runs them, each once."""
    grouped: dict[str, list[str]] = {group: [] for group in GROUPS}
    for row in ROWS:
        for node_id in row.node_ids:
            group = next((name for name, (folder, _) in GROUPS.items() if node_id.startswith(folder)), None)
            if group is None:
                raise ValueError(
                    f"{node_id} is in no group's folder {[f for f, _ in GROUPS.values()]}: add its folder to GROUPS"
                )
            if node_id not in grouped[group]:
                grouped[group].append(node_id)
    return grouped
