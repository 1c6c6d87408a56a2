pytest_plugins = ["moe_runtime.testing.plugin"]
