"""Test-only helpers shipped with the package (the engine process imports them by name): the fault
hook (`faults`, driven by `EngineConfig.fault_injection`) and tiny random models (`models`)."""
