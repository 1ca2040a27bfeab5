"""Creates exactly one shipping label per order, however many distinct events carry it.

The Python twin of ``examples/shipping-label`` (Rust): for the same messages it makes the
same decisions and writes the same state, byte for byte. Payload:
``{"type":"OrderPlaced","order_id":"o-1",...}``. For ``OrderPlaced`` the handler records
``order_id`` in the ``label`` uniqueness namespace and, only the first time, writes
``label/<order_id>`` = ``{"label_id":"<operation_key("label")>","order_id":"<order_id>"}``.
Other event types are acknowledged without writes; an ``OrderPlaced`` without a non-empty
string ``order_id``, or any event whose ``order_id`` is not a string, is a permanent error,
as is a payload that is not a JSON object with a string ``type``.
"""

import json

import dedupd_sdk
from dedupd_sdk import Message, Permanent, insert_unique, operation_key, state

FIELDS = ("type", "order_id")


def fields(pairs: list) -> dict:
    """The object's pairs; like serde in the Rust twin, a repeated field is an error."""
    obj = {}
    for k, v in pairs:
        if k in obj and k in FIELDS:
            raise ValueError(f"duplicate field `{k}`")
        obj[k] = v
    return obj


def handle(msg: Message) -> None:
    event = msg.json(object_pairs_hook=fields)
    if isinstance(event, list) and 1 <= len(event) <= 2:
        # serde reads a struct from an array too, field by field: so does the twin.
        event = dict(zip(FIELDS, event))
    if not isinstance(event, dict):
        raise Permanent("invalid payload: expected a JSON object")
    if "type" not in event:
        raise Permanent("invalid payload: missing field `type`")
    kind = event.get("type")
    if not isinstance(kind, str):
        raise Permanent("invalid payload: `type` must be a string")
    order_id = event.get("order_id")
    if order_id is not None and not isinstance(order_id, str):
        raise Permanent("invalid payload: `order_id` must be a string")
    if kind != "OrderPlaced":
        return
    if not order_id:
        raise Permanent("OrderPlaced without a string order_id")
    if insert_unique("label", order_id):
        label = {"label_id": operation_key("label"), "order_id": order_id}
        # Compact, in this order and escaped as serde_json does: the same bytes as Rust.
        state.put(
            f"label/{order_id}",
            json.dumps(label, separators=(",", ":"), ensure_ascii=False),
        )


Handler = dedupd_sdk.export(handle)
