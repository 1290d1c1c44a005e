"""Test helpers shared by the tests (imported as `support.*`: `tests/` is on pytest's path)."""
