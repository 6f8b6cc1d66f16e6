"""The actor kernel: actors with bounded mailboxes, typed messages, supervision, pinned threads.

It knows nothing of LLMs, MLX or HTTP. See docs/actors.md.
"""

from troupe.runtime.actor import Actor
from troupe.runtime.errors import ActorDead, AskTimeout, MailboxFull
from troupe.runtime.messages import Message
from troupe.runtime.ref import ActorRef
from troupe.runtime.reply import Reply, ReplyStream
from troupe.runtime.snapshot import ActorSnapshot, ActorState, ErrorInfo
from troupe.runtime.supervision import Restart
from troupe.runtime.system import ActorSystem

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
