"""The official `stripe` Python package against a real oncepay: every call a
charges integration makes, every error class it catches, and the SDK's own
retries ending in exactly one charge, counted in the database."""

import base64
import json
import secrets
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import stripe


def client(oncepay, base=None, **kwargs):
    return stripe.StripeClient(
        oncepay.api_key, base_addresses={"api": base or oncepay.base}, **kwargs
    )


def tagged(amount, source="tok_visa"):
    """Charge parameters with a tag of their own, to count them in the database."""
    tag = "py-" + secrets.token_hex(6)
    return tag, {"amount": amount, "currency": "usd", "source": source, "metadata": {"test": tag}}


def test_create_then_retrieve_gives_the_same_charge(oncepay):
    sdk = client(oncepay)
    tag, params = tagged(2000)
    charge = sdk.v1.charges.create(params=params)
    assert isinstance(charge, stripe.Charge)
    assert (charge.status, charge.amount, charge.currency, charge.paid) == ("succeeded", 2000, "usd", True)
    assert charge.metadata["test"] == tag
    assert charge.last_response.code == 200, "a create is 200, as Stripe answers it"
    again = sdk.v1.charges.retrieve(charge.id)
    assert again.to_dict() == charge.to_dict()
    assert charge.last_response.headers["Request-Id"] == charge.last_response.request_id
    assert oncepay.charges_tagged(tag) == 1


def test_the_same_idempotency_key_gives_the_same_charge_once(oncepay):
    sdk = client(oncepay)
    tag, params = tagged(1500)
    key = str(uuid.uuid4())
    first = sdk.v1.charges.create(params=params, options={"idempotency_key": key})
    second = sdk.v1.charges.create(params=params, options={"idempotency_key": key})
    assert second.id == first.id
    assert second.last_response.headers["Idempotent-Replayed"] == "true"
    assert second.last_response.headers["Idempotency-Key"] == key
    assert second.last_response.headers["Original-Request"] == first.last_response.request_id
    assert second.last_response.code == 200
    assert oncepay.charges_tagged(tag) == 1
    assert oncepay.payments_tagged(tag) == 1


def test_auto_paging_walks_every_charge_forward_and_back(oncepay):
    sdk = client(oncepay)
    ids = [sdk.v1.charges.create(params=tagged(100 + i)[1]).id for i in range(5)]
    newest_first = list(reversed(ids))
    listed = [c.id for c in sdk.v1.charges.list(params={"limit": 2}).auto_paging_iter()]
    assert listed[:5] == newest_first, "the newest five, newest first"
    assert len(listed) == len(set(listed)) == oncepay.count("SELECT count(*) FROM charges")
    # From the oldest of the five back up to the newest: the SDK pages with
    # ending_before and yields the charges nearest the cursor first.
    back = [
        c.id
        for c in sdk.v1.charges.list(params={"limit": 2, "ending_before": ids[0]}).auto_paging_iter()
    ]
    assert back == ids[1:]


def test_a_partial_then_full_refund_and_the_balance(oncepay):
    sdk = client(oncepay)
    before = sdk.v1.balance.retrieve()
    charge = sdk.v1.charges.create(params=tagged(3000)[1])
    partial = sdk.v1.refunds.create(params={"charge": charge.id, "amount": 1000})
    assert isinstance(partial, stripe.Refund)
    assert (partial.status, partial.amount, partial.charge) == ("succeeded", 1000, charge.id)
    rest = sdk.v1.refunds.create(params={"charge": charge.id})
    assert rest.amount == 2000
    assert sdk.v1.refunds.retrieve(rest.id).id == rest.id
    refunded = sdk.v1.charges.retrieve(charge.id)
    assert (refunded.amount_refunded, refunded.refunded) == (3000, True)
    after = sdk.v1.balance.retrieve()
    assert isinstance(after, stripe.Balance)
    usd = lambda b: next((x for x in b.available if x.currency == "usd"), {"amount": 0})["amount"]  # noqa: E731
    assert usd(after) == usd(before), "charged 3000, refunded 3000"
    assert oncepay.count(f"SELECT amount_refunded FROM charges WHERE id = '{charge.id}'") == 3000


def test_an_authorized_charge_is_captured_once_by_racing_captures(oncepay):
    tag, params = tagged(2000)
    charge = client(oncepay).v1.charges.create(params={**params, "capture": False})
    assert (charge.paid, charge.captured, charge.amount_captured) == (True, False, 0)

    def capture(i):
        try:
            return client(oncepay, max_network_retries=0).v1.charges.capture(
                charge.id, params={"amount": 1500}, options={"idempotency_key": f"{tag}-{i % 2}"}
            )
        except stripe.StripeError as e:
            return e

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(capture, range(8)))
    captured = [a for a in answers if isinstance(a, stripe.Charge)]
    assert captured and all(c.amount_captured == 1500 for c in captured)
    for refused in (a for a in answers if not isinstance(a, stripe.Charge)):
        assert isinstance(refused, (stripe.InvalidRequestError, stripe.APIError)), refused
        assert refused.error.code in ("charge_already_captured", "idempotency_key_in_use")
    after = client(oncepay).v1.charges.retrieve(charge.id)
    # The 500 not captured is released with no refund, as at Stripe since 2025-03-31.basil.
    assert (after.captured, after.amount_captured, after.amount_refunded) == (True, 1500, 0)
    assert after.refunds.data == []
    assert oncepay.count(f"SELECT count(*) FROM events WHERE object_id = '{charge.id}' AND type = 'charge.captured'") == 1
    with pytest.raises(stripe.InvalidRequestError) as again:
        client(oncepay).v1.charges.capture(charge.id)
    assert again.value.error.code == "charge_already_captured"


def test_a_capture_with_no_body_and_no_content_type_captures_the_whole_amount(oncepay):
    charge = client(oncepay).v1.charges.create(params={**tagged(7200)[1], "capture": False})
    # `curl -X POST .../v1/charges/{id}/capture -u sk_...:`, as Stripe's docs
    # show it: basic auth, no body, no Content-Type.
    token = base64.b64encode(f"{oncepay.api_key}:".encode()).decode()
    request = urllib.request.Request(
        f"{oncepay.base}/v1/charges/{charge.id}/capture",
        method="POST",
        headers={"Authorization": f"Basic {token}"},
    )
    assert request.data is None and not request.has_header("Content-type")
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200
        captured = json.load(answer)
    assert (captured["captured"], captured["amount_captured"]) == (True, 7200)
    again = client(oncepay).v1.charges.retrieve(charge.id)
    assert (again.captured, again.amount_captured, again.amount_refunded) == (True, 7200, 0)
    assert oncepay.count(f"SELECT count(*) FROM events WHERE object_id = '{charge.id}' AND type = 'charge.captured'") == 1


def test_updates_merge_and_unset_metadata_and_change_a_description(oncepay):
    sdk = client(oncepay)
    tag, params = tagged(2000)
    charge = sdk.v1.charges.create(params={**params, "metadata": {"test": tag, "order": "1"}})
    updated = sdk.v1.charges.update(
        charge.id,
        params={"description": "Order 1", "metadata": {"order": "", "note": "gift"}},
        options={"idempotency_key": f"{tag}-update"},
    )
    assert isinstance(updated, stripe.Charge)
    assert updated.description == "Order 1"
    assert updated.metadata.to_dict() == {"test": tag, "note": "gift"}
    assert sdk.v1.charges.retrieve(charge.id).metadata.to_dict() == {"test": tag, "note": "gift"}
    assert oncepay.count(f"SELECT count(*) FROM events WHERE object_id = '{charge.id}' AND type = 'charge.updated'") == 1
    refund = sdk.v1.refunds.create(params={"charge": charge.id, "amount": 500})
    refund = sdk.v1.refunds.update(refund.id, params={"metadata": {"reason": "damaged"}})
    assert refund.metadata.to_dict() == {"reason": "damaged"}


def test_an_endpoint_is_updated_and_disabled_by_the_sdk(oncepay):
    sdk = client(oncepay)
    endpoint = sdk.v1.webhook_endpoints.create(
        params={"url": "http://127.0.0.1:9/hooks", "enabled_events": ["charge.succeeded"]}
    )
    try:
        updated = sdk.v1.webhook_endpoints.update(
            endpoint.id,
            params={"enabled_events": ["charge.failed", "charge.refunded"], "disabled": True},
        )
        assert updated.enabled_events == ["charge.failed", "charge.refunded"]
        assert updated.status == "disabled"
        enabled = sdk.v1.webhook_endpoints.update(endpoint.id, params={"disabled": False})
        assert enabled.status == "enabled"
    finally:
        sdk.v1.webhook_endpoints.delete(endpoint.id)


def test_a_charge_keeps_the_details_it_was_created_with(oncepay):
    shipping = {"name": "Jenny Rosen", "address": {"line1": "1 Main St", "city": "Paris", "country": "FR"}}
    charge = client(oncepay).v1.charges.create(
        params={
            **tagged(2000)[1],
            "receipt_email": "jenny@example.com",
            "statement_descriptor_suffix": "ORDER 6735",
            "shipping": shipping,
        }
    )
    again = client(oncepay).v1.charges.retrieve(charge.id)
    assert again.receipt_email == "jenny@example.com"
    assert again.shipping.name == "Jenny Rosen"
    assert again.shipping.address.line1 == "1 Main St"
    assert again.calculated_statement_descriptor.endswith("ORDER 6735")


def test_refunds_are_listed_all_by_charge_and_through_the_charge(oncepay):
    sdk = client(oncepay)
    charge = sdk.v1.charges.create(params=tagged(3000)[1])
    other = sdk.v1.charges.create(params=tagged(3000)[1])
    first = sdk.v1.refunds.create(params={"charge": charge.id, "amount": 1000})
    second = sdk.v1.refunds.create(params={"charge": charge.id, "amount": 500})
    elsewhere = sdk.v1.refunds.create(params={"charge": other.id, "amount": 100})
    by_charge = sdk.v1.refunds.list(params={"charge": charge.id})
    assert [r.id for r in by_charge.data] == [second.id, first.id]
    assert all(isinstance(r, stripe.Refund) for r in by_charge.data)
    every = [r.id for r in sdk.v1.refunds.list(params={"limit": 1}).auto_paging_iter()]
    assert every[:3] == [elsewhere.id, second.id, first.id], "newest first"
    assert len(every) == len(set(every)) == oncepay.count("SELECT count(*) FROM refunds")
    # The charge's refunds, read from the URL the charge gives for them.
    refunds = sdk.v1.charges.retrieve(charge.id).refunds
    assert refunds.url == f"/v1/charges/{charge.id}/refunds"
    assert [r.id for r in refunds.list(limit=1).auto_paging_iter()] == [second.id, first.id]
    assert refunds.retrieve(first.id).to_dict() == sdk.v1.refunds.retrieve(first.id).to_dict()
    with pytest.raises(stripe.InvalidRequestError) as refused:
        sdk.v1.refunds.list(params={"charge": "ch_nope"})
    assert (refused.value.http_status, refused.value.code, refused.value.param) == (400, "resource_missing", "charge")


def test_a_created_filter_lists_what_was_created_in_its_seconds(oncepay):
    sdk = client(oncepay)
    old = sdk.v1.charges.create(params=tagged(100)[1])
    new = sdk.v1.charges.create(params=tagged(100)[1])
    refund = sdk.v1.refunds.create(params={"charge": old.id})
    # Created in 2001, as far as the lists know.
    moved = oncepay.count(
        "WITH c AS (UPDATE charges SET created_at = to_timestamp(1000000000.5) "
        f"WHERE id = '{old.id}' RETURNING 1) SELECT count(*) FROM c"
    )
    assert moved == 1
    since = [c.id for c in sdk.v1.charges.list(params={"created": {"gte": new.created}}).auto_paging_iter()]
    assert new.id in since and old.id not in since
    until = sdk.v1.charges.list(params={"created": {"lte": 1000000000}})
    assert [c.id for c in until.data] == [old.id]
    refunds = sdk.v1.refunds.list(params={"charge": old.id, "created": {"gte": refund.created}})
    assert [r.id for r in refunds.data] == [refund.id]
    assert sdk.v1.refunds.list(params={"created": {"gt": refund.created + 10}}).data == []
    with pytest.raises(stripe.InvalidRequestError) as refused:
        sdk.v1.charges.list(params={"created": {"gte": "soon"}})
    assert (refused.value.code, refused.value.param) == ("parameter_invalid_integer", "created[gte]")


@pytest.mark.parametrize(
    "source, code, decline_code, param",
    [
        ("tok_chargeDeclined", "card_declined", "generic_decline", None),
        ("tok_chargeDeclinedInsufficientFunds", "card_declined", "insufficient_funds", None),
        ("pm_card_chargeDeclinedInsufficientFunds", "card_declined", "insufficient_funds", None),
        ("tok_chargeDeclinedExpiredCard", "expired_card", None, "exp_month"),
        ("tok_chargeDeclinedIncorrectCvc", "incorrect_cvc", None, "cvc"),
        ("tok_chargeDeclinedProcessingError", "processing_error", None, None),
    ],
)
def test_a_decline_raises_card_error_with_its_codes_and_charge(oncepay, source, code, decline_code, param):
    tag, params = tagged(500, source)
    with pytest.raises(stripe.CardError) as raised:
        client(oncepay).v1.charges.create(params=params)
    e = raised.value
    assert (e.http_status, e.code, e.error.decline_code, e.param) == (402, code, decline_code, param)
    assert e.error.doc_url == "https://stripe.com/docs/error-codes/" + code.replace("_", "-")
    assert e.error.type == "card_error"
    assert e.error.charge.startswith("ch_")
    assert e.request_id and e.headers["Stripe-Should-Retry"] == "false"
    assert oncepay.sql(f"SELECT status FROM charges WHERE id = '{e.error.charge}'") == "failed"
    assert oncepay.payments_tagged(tag) == 0


@pytest.mark.parametrize(
    "params, code, param",
    [
        ({"currency": "usd", "source": "tok_visa"}, "parameter_missing", "amount"),
        ({"amount": 0, "currency": "usd", "source": "tok_visa"}, "parameter_invalid_integer", "amount"),
        ({"amount": 5, "currency": "usd", "source": "tok_visa"}, "amount_too_small", "amount"),
        ({"amount": 100, "currency": "usx", "source": "tok_visa"}, "invalid_currency", "currency"),
        ({"amount": 100, "currency": "usd", "source": "tok_nope"}, "resource_missing", "source"),
        ({"amount": 100, "currency": "usd", "source": "tok_visa", "colour": "red"}, "parameter_unknown", "colour"),
        (
            {"amount": 100, "currency": "usd", "source": "tok_visa", "expand": ["balance_transaction"]},
            "property_not_expandable",
            "expand",
        ),
    ],
)
def test_bad_parameters_raise_invalid_request_error_naming_the_parameter(oncepay, params, code, param):
    before = oncepay.count("SELECT count(*) FROM charges")
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client(oncepay).v1.charges.create(params=params)
    e = raised.value
    assert (e.http_status, e.code, e.param) == (400, code, param)
    assert e.error.type == "invalid_request_error"
    assert oncepay.count("SELECT count(*) FROM charges") == before, "nothing written"


def test_an_unknown_route_raises_invalid_request_error_404(oncepay):
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client(oncepay).v1.payment_intents.create(params={"amount": 2000, "currency": "usd"})
    e = raised.value
    assert e.http_status == 404
    assert e.error.type == "invalid_request_error"
    assert e.error.message.startswith("Unrecognized request URL (POST: /v1/payment_intents).")


def test_a_card_of_each_new_brand_pays(oncepay):
    sdk = client(oncepay)
    for source, brand, last4 in [
        ("tok_jcb", "jcb", "0505"),
        ("tok_unionpay", "unionpay", "0005"),
        ("tok_diners", "diners", "0004"),
        ("pm_card_mastercard_prepaid", "mastercard", "5100"),
    ]:
        charge = sdk.v1.charges.create(params=tagged(2000, source)[1])
        card = charge.payment_method_details.card
        assert (charge.status, card.brand, card.last4) == ("succeeded", brand, last4), source
    risky = sdk.v1.charges.create(params=tagged(2000, "tok_riskLevelElevated")[1])
    assert (risky.status, risky.outcome.risk_level, risky.outcome.type) == ("succeeded", "elevated", "manual_review")


def test_an_unknown_charge_raises_invalid_request_error_404(oncepay):
    with pytest.raises(stripe.InvalidRequestError) as raised:
        client(oncepay).v1.charges.retrieve("ch_doesnotexist")
    e = raised.value
    assert (e.http_status, e.code, e.param) == (404, "resource_missing", "id")


def test_a_wrong_api_key_raises_authentication_error(oncepay):
    wrong = stripe.StripeClient("sk_test_" + "0" * 40, base_addresses={"api": oncepay.base})
    with pytest.raises(stripe.AuthenticationError) as raised:
        wrong.v1.charges.list()
    e = raised.value
    assert (e.http_status, e.error.code, e.error.type) == (401, "invalid_api_key", "invalid_request_error")


def test_an_over_refund_raises_invalid_request_error_and_refunds_nothing(oncepay):
    sdk = client(oncepay)
    charge = sdk.v1.charges.create(params=tagged(1000)[1])
    with pytest.raises(stripe.InvalidRequestError) as raised:
        sdk.v1.refunds.create(params={"charge": charge.id, "amount": 1001})
    e = raised.value
    assert (e.http_status, e.code, e.param) == (400, "amount_too_large", "amount")
    assert oncepay.count(f"SELECT count(*) FROM refunds WHERE charge_id = '{charge.id}'") == 0
    assert oncepay.count(f"SELECT amount_refunded FROM charges WHERE id = '{charge.id}'") == 0


def test_a_reused_key_raises_idempotency_error_and_charges_once(oncepay):
    sdk = client(oncepay)
    tag, params = tagged(700)
    key = str(uuid.uuid4())
    sdk.v1.charges.create(params=params, options={"idempotency_key": key})
    with pytest.raises(stripe.IdempotencyError) as raised:
        sdk.v1.charges.create(params={**params, "amount": 701}, options={"idempotency_key": key})
    e = raised.value
    assert (e.http_status, e.error.type, e.error.code) == (400, "idempotency_error", "idempotency_key_reused")
    assert e.headers["Stripe-Should-Retry"] == "false"
    assert oncepay.charges_tagged(tag) == 1


def test_a_processor_outage_raises_api_error_and_moves_no_money(oncepay):
    tag, params = tagged(900, "tok_processorUnavailable")
    with pytest.raises(stripe.APIError) as raised:
        client(oncepay, max_network_retries=0).v1.charges.create(params=params)
    e = raised.value
    assert (e.http_status, e.error.code, e.error.type) == (503, "processor_unavailable", "api_error")
    assert e.headers["Stripe-Should-Retry"] == "true"
    assert oncepay.payments_tagged(tag) == 0


def test_a_duplicate_in_flight_raises_api_error_409_that_asks_for_a_retry(oncepay):
    sdk = client(oncepay, max_network_retries=0)
    tag, params = tagged(800, "tok_processorTimeoutAfterCapture")
    key = str(uuid.uuid4())
    with pytest.raises(stripe.APIError) as first:
        sdk.v1.charges.create(params=params, options={"idempotency_key": key})
    assert (first.value.http_status, first.value.error.code) == (503, "processing_outcome_unknown")
    # The key stays claimed until recovery settles the charge.
    with pytest.raises(stripe.APIError) as second:
        sdk.v1.charges.create(params=params, options={"idempotency_key": key})
    e = second.value
    assert (e.http_status, e.error.code) == (409, "idempotency_key_in_use")
    assert e.headers["Stripe-Should-Retry"] == "true" and int(e.headers["Retry-After"]) >= 1
    assert oncepay.charges_tagged(tag) == 1


def test_sdk_retries_through_a_lost_answer_make_one_charge(oncepay, lossy_proxy):
    # No key given: the SDK makes one up for the POST and sends it again on
    # each retry. The first answer is lost after the charge committed.
    sdk = client(oncepay, base=f"http://127.0.0.1:{lossy_proxy.port}", max_network_retries=2)
    tag, params = tagged(1200)
    lossy_proxy.lose_next()
    charge = sdk.v1.charges.create(params=params)
    assert lossy_proxy.lost == 1, "the first answer was lost"
    assert charge.status == "succeeded"
    assert charge.last_response.headers["Idempotent-Replayed"] == "true", "the retry was a replay"
    assert oncepay.charges_tagged(tag) == 1
    assert oncepay.payments_tagged(tag) == 1
    key = oncepay.sql(f"SELECT key FROM idempotency_keys WHERE charge_id = '{charge.id}'")
    assert uuid.UUID(key), "the SDK's own key, a bare UUID"


def test_without_retries_a_lost_answer_is_a_connection_error_and_the_key_recovers_it(oncepay, lossy_proxy):
    sdk = client(oncepay, base=f"http://127.0.0.1:{lossy_proxy.port}", max_network_retries=0)
    tag, params = tagged(1300)
    key = str(uuid.uuid4())
    lossy_proxy.lose_next()
    with pytest.raises(stripe.APIConnectionError):
        sdk.v1.charges.create(params=params, options={"idempotency_key": key})
    assert oncepay.charges_tagged(tag) == 1, "the charge committed; only its answer was lost"
    again = sdk.v1.charges.create(params=params, options={"idempotency_key": key})
    assert again.status == "succeeded"
    assert oncepay.charges_tagged(tag) == 1
    assert oncepay.payments_tagged(tag) == 1


def test_sdk_retries_through_processing_outcome_unknown_make_one_succeeded_charge(oncepay):
    # The processor captures, then times out: 503 processing_outcome_unknown,
    # then 409 while the key is claimed, then, once the claim is stale, the
    # retry settles the charge from the processor's record and answers it.
    sdk = client(oncepay, max_network_retries=8)
    tag, params = tagged(1400, "tok_processorTimeoutAfterCapture")
    charge = sdk.v1.charges.create(params=params)
    assert (charge.status, charge.amount) == ("succeeded", 1400)
    assert oncepay.charges_tagged(tag) == 1
    assert oncepay.payments_tagged(tag) == 1


def rate_limited_writes(oncepay):
    with urllib.request.urlopen(oncepay.base + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    line = next(l for l in metrics.splitlines() if l.startswith('rate_limited_total{kind="write"}'))
    return float(line.split()[-1])


def test_over_the_rate_limit_without_retries_raises_rate_limit_error_and_writes_nothing(rate_limited_oncepay):
    sdk = client(rate_limited_oncepay, max_network_retries=0)
    first_tag, first = tagged(1500)
    sdk.v1.charges.create(params=first)
    tag, params = tagged(1600)
    with pytest.raises(stripe.RateLimitError) as raised:
        sdk.v1.charges.create(params=params)
    e = raised.value
    assert (e.http_status, e.error.code) == (429, "rate_limit")
    headers = {k.lower(): v for k, v in e.headers.items()}
    assert int(headers["retry-after"]) >= 1
    assert headers["stripe-should-retry"] == "true"
    assert rate_limited_oncepay.charges_tagged(first_tag) == 1
    assert rate_limited_oncepay.charges_tagged(tag) == 0


def test_sdk_retries_a_429_after_retry_after_to_one_charge_each(rate_limited_oncepay):
    sdk = client(rate_limited_oncepay, max_network_retries=3)
    refused_before = rate_limited_writes(rate_limited_oncepay)
    tags = []
    for amount in (1700, 1800, 1900):
        tag, params = tagged(amount)
        tags.append(tag)
        charge = sdk.v1.charges.create(params=params)
        assert (charge.amount, charge.status) == (amount, "succeeded")
    assert rate_limited_writes(rate_limited_oncepay) > refused_before, "some were answered 429 first"
    assert [rate_limited_oncepay.charges_tagged(t) for t in tags] == [1, 1, 1]
