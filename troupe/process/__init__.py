"""The EngineCore in its own process: wire protocol, ZMQ bridge, parent-side client, child entry point.

See docs/multiprocess.md for the process model, the handshake, death detection and shutdown.
"""
