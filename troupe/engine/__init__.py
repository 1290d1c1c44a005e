"""What runs beside the model, wherever it runs (a thread of the frontend's process, an engine process, a
Ray actor): building the EngineCore (`build`), the engine-core actor that steps it (`core_actor`) and the
engine process's main (`child`: spawned, or headless with `troupe engine --connect`).

The layering is one way: core -> process (the wire) -> engine -> engine_side (the frontend's sides of
an engine) -> actors -> facades -> server / cli.
"""
