"""hybridlm: hybrid Transformer-SSM language models with one cache for every layer kind.

Importing the package registers ``model_type="hybridlm"`` with transformers' Auto classes.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import HybridCache
from .config import HybridConfig
from .formats import load
from .model import HybridForCausalLM, HybridModel

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModel.register(HybridConfig, HybridModel, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)

__all__ = ["HybridCache", "HybridConfig", "HybridForCausalLM", "HybridModel", "load"]
__version__ = "0.1.0"
