"""pallas-flash: exact, memory-lean FlashAttention for JAX, in Pallas."""

from pallas_flash.api import IMPLEMENTATIONS as IMPLEMENTATIONS
from pallas_flash.api import flash_attention as flash_attention
from pallas_flash.configs import BlockwiseConfig as BlockwiseConfig
from pallas_flash.configs import MosaicBwdConfig as MosaicBwdConfig
from pallas_flash.configs import MosaicConfig as MosaicConfig
from pallas_flash.configs import TritonBwdConfig as TritonBwdConfig
from pallas_flash.configs import TritonConfig as TritonConfig
from pallas_flash.ring import ring_attention as ring_attention

__version__ = "0.1.0"
from pallas_flash.sparsity import BlockSparse as BlockSparse
