"""{{name}}: a dedupd handler that counts the events of each order.

Payload: a JSON object with a string ``order_id``, e.g.
``{"type":"OrderPlaced","order_id":"o-1"}``. Each event adds one to ``count/<order_id>`` in
the handler's state (a decimal number).

A plain ``get + 1`` is safe here because dedupd runs a handler once per message id: a
redelivery of the same event is recognised as a duplicate and never reaches ``handle``,
and every write below commits together with the message's claim, or not at all.
"""

import dedupd_sdk
from dedupd_sdk import Message, Permanent, log, state


def handle(msg: Message) -> None:
    # Not JSON, or no string `order_id`: a permanent error, so the message is
    # dead-lettered instead of retried.
    event = msg.json()
    order_id = event.get("order_id") if isinstance(event, dict) else None
    if not isinstance(order_id, str):
        raise Permanent("payload without a string order_id")
    if not order_id:
        raise Permanent("empty order_id")
    key = f"count/{order_id}"
    stored = state.get(key)
    count = int(stored) if stored is not None and stored.isdigit() else 0
    state.put(key, str(count + 1))
    log.info(f"{key} = {count + 1}")


# componentize-py finds the export under this name.
Handler = dedupd_sdk.export(handle)
