"""What runs an EngineCore, wherever it runs (a worker thread of the frontend, an engine process, a
Ray actor): building it (`build`) and the engine-core actor that steps it (`core_actor`).

The layering is one way: core -> engine -> process -> actors -> facades -> server / cli. The engine
process (troupe.process.engine_main) and the in-process engine side (troupe.actors.engine_side)
both build a core and report it ready through this package; neither imports the other.
"""
