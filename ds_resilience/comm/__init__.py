"""Communication between ranks (layer L4, torch.distributed): process groups addressed by global
ranks, point-to-point activation/gradient messages, and the one state transport (JSON header, raw
bytes) used by replication, restore and re-join. Nothing here unpickles what a peer sent."""

from .groups import CommError, GenerationGroups, Group, build_groups, new_group, poison, world_group
from .p2p import Messenger, message_tag
from .transport import Message, TransportError, recv_header, recv_payload, send_message

__all__ = [
    "CommError",
    "GenerationGroups",
    "Group",
    "Message",
    "Messenger",
    "TransportError",
    "build_groups",
    "message_tag",
    "new_group",
    "poison",
    "recv_header",
    "recv_payload",
    "send_message",
    "world_group",
]
