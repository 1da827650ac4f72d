"""Reference tests the compat harness does not run, each with the reason.

Only tests of the reference's internals belong here (its controller's or storage's private state
and on-disk layout, zmq, its own logging). Keys are pytest node ids relative to the extracted
wheel; an id without ``[params]`` covers every parametrization. The harness fails when an entry
no longer matches a collected test.
"""

_CKPT = "tests/e2e/test_checkpoint_e2e.py"
_SSD = "tests/e2e/test_ssd_offload_e2e.py"

DESELECTED: dict[str, str] = {
    "tests/test_metadata.py::TestStorageUnitDataStrict::test_put_data_length_mismatch_raises":
        "unit test of the reference's storage node class (transfer_queue.storage.simple_storage.StorageUnitData)",
    f"{_CKPT}::TestCheckpointRoundtrip::test_tensor_fields":
        "asserts the reference's checkpoint file layout (controller_state.pkl, simple_storage/storage_unit_info.json)",
    f"{_CKPT}::TestIncludeStorageFalse::test_storage_saved_is_true":
        "asserts the reference's checkpoint layout (a simple_storage/ directory); that the data is saved "
        "anyway is test_both_restored_after_load",
    f"{_CKPT}::TestCheckpointErrors::test_save_raises_if_not_initialized":
        "sets the reference's private module global transfer_queue.interface._TQ_CONTROLLER",
    f"{_CKPT}::TestCheckpointErrors::test_load_raises_if_not_initialized":
        "sets the reference's private module global transfer_queue.interface._TQ_CONTROLLER",
    f"{_CKPT}::TestCheckpointErrors::test_load_raises_on_storage_unit_count_mismatch":
        "edits the reference's storage-unit file simple_storage/storage_unit_info.json inside a checkpoint",
    f"{_CKPT}::TestCheckpointErrors::test_no_partial_state_on_failed_save":
        "patches TransferQueueClient.save_storage_checkpoint, an internal step of the reference's checkpoint",
    f"{_SSD}::test_public_api_routes_per_sample_and_migrates_on_overwrite":
        "counts the reference's per-sample SSD files (*.bin) under its transfer_queue_ssd_offload/ directory",
    f"{_SSD}::test_checkpoint_round_trip_recreates_ssd_data":
        "asserts the reference's SSD file layout (*.bin, simple_storage/*.pkl.blobs/) and, in its fixture, "
        "the transfer_queue_ssd_offload/ directory",
}
