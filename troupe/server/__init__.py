"""troupe's OpenAI-compatible HTTP server (`troupe serve`, docs/server.md).

Modules: `app` (the Starlette app and its small endpoints), `serving` (the completions and chat
endpoints), `protocol` (request bodies, mapping to SamplingParams) and `chat` (messages, tools, tool
choice), `fields` (unknown fields, fields troupe cannot honour), `completions` and `chat_format`
(the answers, whole and streamed), `logprobs` (OpenAI's logprob shapes), `responses` (response
bodies), `sse` (the streaming response), `state` (per-app state and the engine interface),
`metrics` (Prometheus), `errors` (OpenAI error bodies), `openapi` (/openapi.json), `launcher`
(uvicorn, signals, engine death). The streaming-client benchmark is `troupe.bench.server`.
"""
