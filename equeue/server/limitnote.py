"""Error texts that name a setting the broker's user can change. The store names its
own settings (``StoreConfig.max_message_size``); where the broker opened the store
itself and lowered that limit to what one frame carries (serve.open_store), a CLI user
cannot reach StoreConfig: the answer names ``equeue serve --max-frame-bytes``."""

from __future__ import annotations

from equeue.errors import MessageTooLargeError
from equeue.store.config import StoreConfig
from equeue.store.store import MessageStore
from equeue.store.validate import BODY_LIMIT_SETTING

_DEFAULT_MAX_MESSAGE_SIZE = StoreConfig().max_message_size


def name_broker_setting(
    exc: BaseException, store: MessageStore, owned: bool, max_frame_bytes: int
) -> BaseException:
    """``exc`` as the client should read it: a body past a max_message_size the broker
    lowered names the broker's setting; anything else as it is."""
    if type(exc) is not MessageTooLargeError or not owned:
        return exc
    if store.config.max_message_size >= _DEFAULT_MAX_MESSAGE_SIZE:
        return exc  # the store's own default: not lowered by the broker
    text = str(exc)
    if not text.endswith(BODY_LIMIT_SETTING):
        return exc
    return MessageTooLargeError(
        text[: -len(BODY_LIMIT_SETTING)]
        + f"(the broker's max_frame_bytes={max_frame_bytes} less room for properties and "
        "framing; raise equeue serve --max-frame-bytes)"
    )
