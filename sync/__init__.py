"""Weight sync: publishing the trainer's weights to the engines and keeping a record of it.

    transports/      full disk, delta disk, distributed broadcast, colocated tensors
    buckets/         tensors grouped, filled and pumped as --update-weight-buffer-size buckets
    factory.py       the transport a run's flags choose
    engine_control   pausing, updating and checking engines over HTTP
    ledger.py        what each published version holds (the truth of what engines serve)
    delta*.py, local_store.py, checkpoint_files.py, hf_writer.py, checksum.py: the files on disk
    cli.py           `tether weights`: diff, apply, verify

May import tether.runtime, the rollout contract and engine_api; never train/ or the head.
"""
