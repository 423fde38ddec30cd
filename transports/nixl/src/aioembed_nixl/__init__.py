"""aioembed-nixl: the NIXL transport for aioembed (NVIDIA Inference Xfer Library, UCX backend).

Select it with ``TransferConfig(transport="nixl", transport_options={...})``; the plugin is found
through the ``aioembed.transports`` entry point. NIXL itself is imported only when an endpoint is
opened, so this package imports (and reports a missing extra clearly) without it.
"""

from aioembed_nixl._options import NETWORK_BACKENDS, NixlOptions
from aioembed_nixl.transport import NixlLink, NixlTransport

__version__ = "0.1.0"

__all__ = ["NETWORK_BACKENDS", "NixlLink", "NixlOptions", "NixlTransport", "__version__"]
