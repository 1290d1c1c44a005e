"""The wire between a frontend and an engine in another process or on another host: the ZMQ bridge,
the codec, the process-boundary protocol (handshake, start, shutdown), spawning settings and the log
channel. Nothing here knows an EngineCore: the engine's side of the wire is troupe.engine.child, the
frontend's is troupe.engine_side.

See docs/multiprocess.md for the process model, the handshake, death detection and shutdown.
"""
