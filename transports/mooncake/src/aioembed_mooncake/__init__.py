"""aioembed-mooncake: the ``mooncake`` transport for aioembed, on Mooncake's ``TransferEngine``.

Select it with ``TransferConfig(transport="mooncake", transport_options={...})`` or
``transport = "mooncake"`` in the TOML config. The engine itself (``mooncake.engine``) is
imported lazily, when the first endpoint opens, so importing this package never fails for a
missing engine or system library; opening an endpoint then raises a ``TransportError`` that
says what to install.
"""

from aioembed_mooncake._engine import MIN_ENGINE_VERSION
from aioembed_mooncake.transport import DESCRIPTOR_VERSION, MooncakeLink, MooncakeTransport, default_hostname

__version__ = "0.1.0"

__all__ = [
    "DESCRIPTOR_VERSION",
    "MIN_ENGINE_VERSION",
    "MooncakeLink",
    "MooncakeTransport",
    "__version__",
    "default_hostname",
]
