"""Repository-wide pytest plugins (the only conftest that may declare ``pytest_plugins``)."""

pytest_plugins = ["pytester", "moe_runtime.testing.plugin"]
