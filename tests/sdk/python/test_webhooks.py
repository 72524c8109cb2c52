"""The official `stripe` Python package with oncepay's webhooks: the SDK
manages the endpoints, and its own `stripe.Webhook.construct_event` verifies
what oncepay delivers, on the raw bytes a receiver on 127.0.0.1 was sent."""

import json
import secrets
import time
import types
import urllib.request

import pytest
import stripe


def client(oncepay):
    return stripe.StripeClient(oncepay.api_key, base_addresses={"api": oncepay.base})


@pytest.fixture
def endpoint(oncepay, webhook_receiver):
    """An endpoint for `charge.succeeded` at the receiver, deleted afterwards."""
    sdk = client(oncepay)
    created = sdk.v1.webhook_endpoints.create(
        params={"url": webhook_receiver.url, "enabled_events": ["charge.succeeded"]}
    )
    yield created
    sdk.v1.webhook_endpoints.delete(created.id)


def charge_and_deliveries(oncepay, receiver, n=1):
    """A new charge, and the first N deliveries of its event."""
    charge = client(oncepay).v1.charges.create(
        params={"amount": 2000, "currency": "usd", "source": "tok_visa"}
    )
    return charge, receiver.of_object(charge.id, n)


def deliveries_api(oncepay, event_id):
    """`GET /v1/events/{id}/deliveries`, plain HTTP with the API key."""
    request = urllib.request.Request(
        f"{oncepay.base}/v1/events/{event_id}/deliveries",
        headers={"Authorization": f"Bearer {oncepay.api_key}"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)


def test_an_endpoint_shows_its_secret_only_when_created_and_is_retrieved_listed_and_deleted(
    oncepay, webhook_receiver
):
    sdk = client(oncepay)
    created = sdk.v1.webhook_endpoints.create(
        params={
            "url": webhook_receiver.url,
            "enabled_events": ["charge.succeeded"],
            "description": "the Python SDK's receiver",
        }
    )
    assert isinstance(created, stripe.WebhookEndpoint)
    assert created.id.startswith("we_")
    assert created.secret.startswith("whsec_")
    assert (created.object, created.url, created.enabled_events, created.status, created.description) == (
        "webhook_endpoint",
        webhook_receiver.url,
        ["charge.succeeded"],
        "enabled",
        "the Python SDK's receiver",
    )

    retrieved = sdk.v1.webhook_endpoints.retrieve(created.id)
    assert isinstance(retrieved, stripe.WebhookEndpoint)
    assert "secret" not in retrieved
    assert retrieved.to_dict() == {k: v for k, v in created.to_dict().items() if k != "secret"}

    listed = list(sdk.v1.webhook_endpoints.list().auto_paging_iter())
    assert created.id in [e.id for e in listed]
    assert all(isinstance(e, stripe.WebhookEndpoint) and "secret" not in e for e in listed)

    deleted = sdk.v1.webhook_endpoints.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "webhook_endpoint", True)
    with pytest.raises(stripe.InvalidRequestError) as raised:
        sdk.v1.webhook_endpoints.retrieve(created.id)
    assert (raised.value.http_status, raised.value.code) == (404, "resource_missing")
    assert created.id not in [e.id for e in sdk.v1.webhook_endpoints.list().auto_paging_iter()]


def test_a_charge_is_delivered_signed_and_construct_event_gives_the_event_the_api_shows(
    oncepay, webhook_receiver, endpoint
):
    charge, [delivery] = charge_and_deliveries(oncepay, webhook_receiver)
    assert delivery.content_type.startswith("application/json")
    event = stripe.Webhook.construct_event(delivery.body, delivery.signature, endpoint.secret)
    assert isinstance(event, stripe.Event)
    assert event.type == "charge.succeeded"
    assert isinstance(event.data.object, stripe.Charge)
    assert event.data.object.id == charge.id
    assert event.data.object.to_dict() == charge.to_dict(), "the charge as the API answered it"

    retrieved = client(oncepay).v1.events.retrieve(event.id)
    assert isinstance(retrieved, stripe.Event)
    assert (retrieved.id, retrieved.type) == (event.id, event.type)
    assert retrieved.data.to_dict() == event.data.to_dict()


@pytest.fixture
def delivered(oncepay, webhook_receiver, endpoint):
    """One genuine delivery, checked to verify, and its endpoint's secret."""
    _, [delivery] = charge_and_deliveries(oncepay, webhook_receiver)
    stripe.Webhook.construct_event(delivery.body, delivery.signature, endpoint.secret)
    return delivery, endpoint.secret


def refused(payload, header, secret, **kwargs):
    with pytest.raises(stripe.SignatureVerificationError) as raised:
        stripe.Webhook.construct_event(payload, header, secret, **kwargs)
    return str(raised.value)


def test_construct_event_refuses_a_tampered_payload(delivered):
    delivery, secret = delivered
    tampered = delivery.body.replace(b'"amount":2000', b'"amount":1', 1)
    assert tampered != delivery.body
    assert "No signatures found matching" in refused(tampered, delivery.signature, secret)
    # Only the bytes as sent verify: the same JSON written again does not.
    rewritten = json.dumps(json.loads(delivery.body), indent=2)
    assert "No signatures found matching" in refused(rewritten, delivery.signature, secret)


def test_construct_event_refuses_a_delivery_checked_with_another_secret(delivered):
    delivery, _ = delivered
    other = "whsec_" + secrets.token_hex(16)
    assert "No signatures found matching" in refused(delivery.body, delivery.signature, other)


def test_construct_event_refuses_a_delivery_older_than_its_tolerance(delivered, monkeypatch):
    delivery, secret = delivered
    # The SDK's clock, moved on: at 300 s (the default tolerance) the
    # signature still holds, at 301 s it is stale.
    clock = types.SimpleNamespace(time=lambda: delivery.timestamp + 300)
    monkeypatch.setattr(stripe._webhook, "time", clock)
    stripe.Webhook.construct_event(delivery.body, delivery.signature, secret)
    clock.time = lambda: delivery.timestamp + 301
    assert "outside the tolerance zone" in refused(delivery.body, delivery.signature, secret)
    clock.time = lambda: delivery.timestamp + 61
    assert "outside the tolerance zone" in refused(
        delivery.body, delivery.signature, secret, tolerance=60
    )


def test_a_delivery_answered_500_is_sent_again_signed_anew_and_the_deliveries_api_shows_both_attempts(
    oncepay, webhook_receiver, endpoint
):
    failed_once = set()

    def answer(delivery):
        if delivery.event["id"] in failed_once:
            return 200
        failed_once.add(delivery.event["id"])
        # Not before the signature's second has passed, so that the retry
        # is signed at a later `t=`.
        while time.time() < delivery.timestamp + 1:
            time.sleep(0.05)
        return 500

    webhook_receiver.answer = answer
    charge, (first, second) = charge_and_deliveries(oncepay, webhook_receiver, n=2)
    events = [stripe.Webhook.construct_event(d.body, d.signature, endpoint.secret) for d in (first, second)]
    assert events[0].id == events[1].id
    assert [e.type for e in events] == ["charge.succeeded"] * 2
    assert events[1].data.object.id == charge.id
    assert second.timestamp > first.timestamp, "each attempt is signed when it is sent"

    # The worker records the second attempt once the receiver has answered it.
    deadline = time.monotonic() + 15
    while True:
        listed = deliveries_api(oncepay, events[0].id)
        mine = [d for d in listed["data"] if d["webhook_endpoint"] == endpoint.id]
        if mine and mine[0]["status"] != "pending":
            break
        assert time.monotonic() < deadline, f"the delivery is still pending: {mine}"
        time.sleep(0.1)
    [delivery] = mine
    assert (delivery["object"], delivery["event"], delivery["url"]) == (
        "webhook_delivery",
        events[0].id,
        webhook_receiver.url,
    )
    assert (delivery["status"], delivery["attempt_count"]) == ("succeeded", 2)
    assert [a["attempt"] for a in delivery["attempts"]] == [1, 2]
    assert [a["response_status"] for a in delivery["attempts"]] == [500, 200]
    assert delivery["attempts"][0]["error"] == "HTTP 500"
    assert len([d for d in webhook_receiver.deliveries if d.event["id"] == events[0].id]) == 2, "and no more"


def test_an_endpoint_for_stripes_refund_created_is_sent_each_refund_and_the_events_list_by_it(
    oncepay, webhook_receiver
):
    sdk = client(oncepay)
    endpoint = sdk.v1.webhook_endpoints.create(
        params={"url": webhook_receiver.url, "enabled_events": ["refund.created", "refund.updated"]}
    )
    try:
        assert endpoint.enabled_events == ["refund.created", "refund.updated"]
        charge = sdk.v1.charges.create(params={"amount": 2000, "currency": "usd", "source": "tok_visa"})
        refund = sdk.v1.refunds.create(params={"charge": charge.id, "amount": 500})
        [delivery] = webhook_receiver.of_object(refund.id)
        event = stripe.Webhook.construct_event(delivery.body, delivery.signature, endpoint.secret)
        assert event.type == "refund.created"
        assert isinstance(event.data.object, stripe.Refund)
        assert event.data.object.to_dict() == refund.to_dict(), "the refund as the API answered it"
        listed = sdk.v1.events.list(params={"type": "refund.created"})
        assert event.id in [e.id for e in listed.data]
        assert all(e.type == "refund.created" for e in listed.data)
        assert oncepay.count(f"SELECT count(*) FROM events WHERE object_id = '{refund.id}'") == 1
    finally:
        sdk.v1.webhook_endpoints.delete(endpoint.id)
    with pytest.raises(stripe.InvalidRequestError) as raised:
        sdk.v1.events.list(params={"type": "refund.succeeded"})
    assert (raised.value.http_status, raised.value.code, raised.value.param) == (
        400,
        "invalid_event_type",
        "type",
    )
