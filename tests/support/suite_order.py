"""The order in which the suite hands its test files to the xdist workers (tests/conftest.py sorts by it)."""

# The longest test files, longest first (measured with a filled cache on the 2-core machine: 80 s of one
# core for test_ray down to 15 s): under `-n 2 --dist loadfile` a long file handed out last leaves one worker
# busy while the other idles, so the files after these are the short ones (a second or two each) and the
# workers end within a few seconds of each other. test_hf_equality goes first: on a machine's first run it
# computes the transformers oracle (about 25 s), which test_gguf_equality, much further down, reads.
LONGEST_FIRST = ("models/test_hf_equality.py", "e2e/test_ray.py", "facades/test_llm.py",
                 "e2e/test_readme_and_cli.py", "models/test_gguf.py", "e2e/test_engine_process.py",
                 "server/test_fuzz_server.py", "e2e/test_ray_local.py", "server/test_server_lifecycle.py",
                 "server/test_attacks.py", "bench/test_bench_harness.py", "e2e/test_sampling_oracle.py",
                 "e2e/test_fuzz_sampling.py", "server/test_soak.py", "e2e/test_sampling_features.py",
                 "kernels/test_cuda_kernel_set.py", "e2e/test_data_parallel.py", "models/test_gguf_equality.py",
                 "server/test_server_openai.py", "server/test_server_default_model.py", "kernels/test_cuda_aot.py",
                 "kernels/test_cpu_build.py", "e2e/test_device.py", "facades/test_async_llm.py",
                 "kernels/test_select.py", "core/test_model_runner.py", "e2e/test_logging.py",
                 "kernels/test_cpu_stack.py", "kernels/test_cpu_attention.py", "server/test_responses.py",
                 "models/test_families.py", "server/test_server.py", "models/test_gguf_families.py",
                 "kernels/test_cuda_attention.py", "models/test_models.py")
