"""troupe's OpenAI-compatible HTTP server (`troupe serve`, docs/server.md).

Modules: `app` (the Starlette app and its small endpoints), `serving` (completions and chat),
`protocol` (request bodies, mapping to SamplingParams), `sse` (the streaming response), `state`
(per-app state and the engine interface), `metrics` (Prometheus), `errors` (OpenAI error bodies),
`launcher` (uvicorn, signals, engine death). The streaming-client benchmark is `troupe.bench.server`.
"""
