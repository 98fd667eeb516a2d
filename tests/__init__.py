"""Test suites, one folder per package; shared test infrastructure (the Kubernetes emulator) lives here too."""
