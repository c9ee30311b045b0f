"""hybridlm checkpoint shim (trust_remote_code): the classes come from the installed hybridlm package."""
from hybridlm import HybridForCausalLM, HybridModel  # noqa: F401
