"""Model integrations: running whole models with their MoE layers through moe-runtime."""
