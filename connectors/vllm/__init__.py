"""vLLM adapter: ``KVStoreConnector``, registered through vLLM's plugin entry point.

Installing kvstore registers the entry point ``vllm.general_plugins: kvstore =
kvstore.connectors.vllm:register``, so ``--kv-transfer-config '{"kv_connector":"KVStoreConnector",
"kv_role":"kv_both","kv_connector_extra_config":{"config":"configs/agent.yaml"}}'`` works
without a module path; ``"kv_connector_module_path":"kvstore.connectors.vllm.connector"`` works too.
"""

NAME = "KVStoreConnector"


def register() -> None:
    """Register KVStoreConnector with vLLM's connector factory (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # vLLM missing or too old: nothing to register
        return
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "kvstore.connectors.vllm.connector", NAME)
