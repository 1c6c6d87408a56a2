# Opt into moe-runtime's conformance suite: its options and the cases generated from declarations.
pytest_plugins = ["moe_runtime.testing.plugin"]
