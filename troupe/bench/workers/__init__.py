"""Engine workers of `troupe bench`: one script per engine, each run in its own process by that engine's
python (`troupe.bench.peers.run_worker`), speaking the protocol of `wire`.

`troupe_worker` and `hf_worker` run on troupe's python; `vllm_worker` and `llamacpp_worker` run on a
peer's venv python and import only the standard library, the peer and `wire` (their sibling: they run as
scripts, so this folder is their `sys.path[0]`), never troupe.
"""
