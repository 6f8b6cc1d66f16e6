"""The actor kernel: actors with bounded mailboxes, typed messages, supervision, pinned threads.

It knows nothing of LLMs, MLX or HTTP. See docs/actors.md.
"""

from runtime.actor import Actor
from runtime.errors import ActorDead, AskTimeout, MailboxFull
from runtime.messages import Message
from runtime.ref import ActorRef
from runtime.reply import Reply, ReplyStream
from runtime.snapshot import ActorSnapshot, ActorState, ErrorInfo
from runtime.supervision import Restart
from runtime.system import ActorSystem

__all__ = [
    "Actor",
    "ActorDead",
    "ActorRef",
    "ActorSnapshot",
    "ActorState",
    "ActorSystem",
    "AskTimeout",
    "ErrorInfo",
    "MailboxFull",
    "Message",
    "Reply",
    "ReplyStream",
    "Restart",
]
