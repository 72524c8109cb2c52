//! The test card tokens, with Stripe's names, and what each card does.
//!
//! The one table both systems read: oncepay accepts these names as a
//! charge's `source` (and refuses any other, as it always has), as well as
//! the test payment methods Stripe documents for the same cards
//! (`pm_card_visa` for `tok_visa`, ...), and the card
//! gateway (crates/card-gateway) decides each authorization's and refund's
//! outcome from them. Like a real gateway's published test cards, the table
//! is a contract both sides know, not code of either; it imports nothing.
//! The card behind each token (brand, last four digits, funding, country)
//! and each decline's codes are the ones Stripe documents for the token.

/// A test card token accepted as a charge `source`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestToken {
    Visa,
    VisaDebit,
    Mastercard,
    MastercardDebit,
    Amex,
    Discover,
    MastercardPrepaid,
    Jcb,
    UnionPay,
    Diners,
    /// Pays, with an elevated risk level: Radar places it in review.
    RiskLevelElevated,
    Declined,
    DeclinedInsufficientFunds,
    DeclinedExpiredCard,
    DeclinedIncorrectCvc,
    DeclinedProcessingError,
    /// Blocked as fraud before it reaches the card network.
    DeclinedFraudulent,
    DeclinedLostCard,
    DeclinedStolenCard,
    /// The processor records the payment, then the call times out.
    ProcessorTimeoutAfterCapture,
    /// The processor records nothing and the call fails at once.
    ProcessorUnavailable,
    /// The payment succeeds; the first refund of it is refused by the card's
    /// issuer, for good. Later refunds of the same charge go through.
    RefundFail,
}

/// The card behind a token, as Stripe describes a card.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Card {
    /// As `payment_method_details.card.brand` spells it: `visa`, `mastercard`,
    /// `amex`, `discover`, `jcb`, `unionpay`, `diners`.
    pub brand: &'static str,
    pub last4: &'static str,
    /// `credit`, `debit` or `prepaid`.
    pub funding: &'static str,
    /// The issuer's country, ISO 3166-1 alpha-2.
    pub country: &'static str,
    /// Stripe's per-card-number fingerprint; here one fixed value per number.
    pub fingerprint: &'static str,
}

impl Card {
    /// Every test card expires at the end of this month: a fixed future date,
    /// so the same charge renders the same way every time.
    pub const EXP_MONTH: i64 = 12;
    pub const EXP_YEAR: i64 = 2034;

    /// The brand as the card (`source`) object spells it: `Visa`, `MasterCard`, ...
    pub fn display_brand(self) -> &'static str {
        match self.brand {
            "visa" => "Visa",
            "mastercard" => "MasterCard",
            "amex" => "American Express",
            "discover" => "Discover",
            "jcb" => "JCB",
            "unionpay" => "UnionPay",
            "diners" => "Diners Club",
            _ => "Unknown",
        }
    }
}

/// A decline, as Stripe reports it: a card declined by its issuer is
/// `card_declined` with the issuer's reason in `decline_code`, except for
/// the declines that have a code of their own (`expired_card`,
/// `incorrect_cvc`, `processing_error`), which carry no `decline_code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decline {
    /// The charge's `failure_code` and the error's `code`.
    pub code: &'static str,
    /// The error's `decline_code`, where Stripe gives one.
    pub decline_code: Option<&'static str>,
    /// The issuer's reason: the charge's `outcome.reason` (for a card
    /// blocked as fraud, `outcome.reason` is `highest_risk_level`).
    pub reason: &'static str,
    /// The error's `param`: the card's field at fault (`exp_month` for an
    /// expired card, `cvc` for a wrong security code).
    pub param: Option<&'static str>,
    pub message: &'static str,
}

/// What a charge's `outcome` says about a card's authorization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// `authorized`, `manual_review`, `issuer_declined` or `blocked`.
    pub kind: &'static str,
    /// `approved_by_network`, `declined_by_network` or `not_sent_to_network`.
    pub network_status: &'static str,
    pub reason: Option<&'static str>,
    /// `normal`, `elevated` or `highest`.
    pub risk_level: &'static str,
    pub seller_message: &'static str,
}

const VISA: Card = card("visa", "4242", "credit", "Xt5EWLLDS7FJjR1c");
const VISA_DEBIT: Card = card("visa", "5556", "debit", "Rw8ZjQ0wYs1kLq7N");
const MASTERCARD: Card = card("mastercard", "4444", "credit", "Jz6s4QmT1bVn8Ke2");
const MASTERCARD_DEBIT: Card = card("mastercard", "8210", "debit", "Pf3uH9cW2xLr5Da0");
const AMEX: Card = card("amex", "8431", "credit", "Gq2nR7vB5mYt0Sx4");
const DISCOVER: Card = card("discover", "1117", "credit", "Lc9wE4kZ6pTh3Ju1");
const MASTERCARD_PREPAID: Card = card("mastercard", "5100", "prepaid", "Vm1cQ8rD3nAs6Lp4");
const JCB: Card = Card {
    country: "JP",
    ..card("jcb", "0505", "credit", "Bx4gN9tW2kHe7Yq0")
};
const UNIONPAY: Card = Card {
    country: "CN",
    ..card("unionpay", "0005", "credit", "Zr6fP1mJ8sCv3Ud5")
};
const DINERS: Card = card("diners", "0004", "credit", "Qh0yE5bT7wKi2Go9");
const RISK_LEVEL_ELEVATED: Card = card("visa", "9235", "credit", "Dn3sL7xA0vRj5Fc8");

const fn card(
    brand: &'static str,
    last4: &'static str,
    funding: &'static str,
    fingerprint: &'static str,
) -> Card {
    Card {
        brand,
        last4,
        funding,
        country: "US",
        fingerprint,
    }
}

const ALL: [(TestToken, &str); 22] = [
    (TestToken::Visa, "tok_visa"),
    (TestToken::VisaDebit, "tok_visa_debit"),
    (TestToken::Mastercard, "tok_mastercard"),
    (TestToken::MastercardDebit, "tok_mastercard_debit"),
    (TestToken::Amex, "tok_amex"),
    (TestToken::Discover, "tok_discover"),
    (TestToken::MastercardPrepaid, "tok_mastercard_prepaid"),
    (TestToken::Jcb, "tok_jcb"),
    (TestToken::UnionPay, "tok_unionpay"),
    (TestToken::Diners, "tok_diners"),
    (TestToken::RiskLevelElevated, "tok_riskLevelElevated"),
    (TestToken::Declined, "tok_chargeDeclined"),
    (
        TestToken::DeclinedInsufficientFunds,
        "tok_chargeDeclinedInsufficientFunds",
    ),
    (
        TestToken::DeclinedExpiredCard,
        "tok_chargeDeclinedExpiredCard",
    ),
    (
        TestToken::DeclinedIncorrectCvc,
        "tok_chargeDeclinedIncorrectCvc",
    ),
    (
        TestToken::DeclinedProcessingError,
        "tok_chargeDeclinedProcessingError",
    ),
    (
        TestToken::DeclinedFraudulent,
        "tok_chargeDeclinedFraudulent",
    ),
    (TestToken::DeclinedLostCard, "tok_chargeDeclinedLostCard"),
    (
        TestToken::DeclinedStolenCard,
        "tok_chargeDeclinedStolenCard",
    ),
    (
        TestToken::ProcessorTimeoutAfterCapture,
        "tok_processorTimeoutAfterCapture",
    ),
    (TestToken::ProcessorUnavailable, "tok_processorUnavailable"),
    (TestToken::RefundFail, "tok_refundFail"),
];

/// The test payment methods Stripe documents for the same cards, accepted as
/// other names of the tokens: `pm_card_` and the token's name after `tok_`.
/// oncepay's own fault tokens have none.
const PAYMENT_METHOD_PREFIX: &str = "pm_card_";

const DECLINED: &str = "Your card was declined.";

impl TestToken {
    /// Accepts a token by its exact name, or by the name of the test
    /// payment method Stripe documents for its card (`pm_card_visa`).
    pub fn parse(name: &str) -> Option<Self> {
        if let Some(card) = name.strip_prefix(PAYMENT_METHOD_PREFIX) {
            return ALL
                .iter()
                .find(|(t, n)| t.has_payment_method() && card_name(n) == card)
                .map(|(t, _)| *t);
        }
        ALL.iter().find(|(_, n)| *n == name).map(|(t, _)| *t)
    }

    /// Whether Stripe documents a test payment method (`pm_card_...`) for
    /// the token's card: every token but oncepay's own fault tokens.
    pub fn has_payment_method(self) -> bool {
        !matches!(
            self,
            TestToken::ProcessorTimeoutAfterCapture | TestToken::ProcessorUnavailable
        )
    }

    /// The name of the test payment method for the token's card, if any.
    pub fn payment_method(self) -> Option<String> {
        self.has_payment_method()
            .then(|| format!("{PAYMENT_METHOD_PREFIX}{}", card_name(self.as_str())))
    }

    pub fn as_str(self) -> &'static str {
        ALL.iter()
            .find(|(t, _)| *t == self)
            .map(|(_, n)| *n)
            .expect("every token is listed")
    }

    /// Every token, in the order docs/api.md lists them.
    pub fn all() -> impl Iterator<Item = TestToken> {
        ALL.iter().map(|(t, _)| *t)
    }

    /// The card behind the token. The declining cards are Visa cards, as
    /// Stripe's are; oncepay's own fault tokens stand for the Visa `4242`.
    pub fn card(self) -> Card {
        match self {
            TestToken::VisaDebit => VISA_DEBIT,
            TestToken::Mastercard => MASTERCARD,
            TestToken::MastercardDebit => MASTERCARD_DEBIT,
            TestToken::Amex => AMEX,
            TestToken::Discover => DISCOVER,
            TestToken::MastercardPrepaid => MASTERCARD_PREPAID,
            TestToken::Jcb => JCB,
            TestToken::UnionPay => UNIONPAY,
            TestToken::Diners => DINERS,
            TestToken::RiskLevelElevated => RISK_LEVEL_ELEVATED,
            TestToken::Declined => card("visa", "0002", "credit", "Hb1yN6dF8sQw2Mv5"),
            TestToken::DeclinedInsufficientFunds => {
                card("visa", "9995", "credit", "Tn4kV0gS3zXe7Rc9")
            }
            TestToken::DeclinedExpiredCard => card("visa", "0069", "credit", "Wd7pJ2hA5uBi1Ny3"),
            TestToken::DeclinedIncorrectCvc => card("visa", "0127", "credit", "Ke0rM8fL4vCo6Zt2"),
            TestToken::DeclinedProcessingError => {
                card("visa", "0119", "credit", "Ys3aG6jP9wDu0Fq8")
            }
            TestToken::DeclinedFraudulent => card("visa", "0019", "credit", "Ua5tX1cK7nEs4Hl6"),
            TestToken::DeclinedLostCard => card("visa", "9987", "credit", "Ip8bZ3mR0yGk5Wj1"),
            TestToken::DeclinedStolenCard => card("visa", "9979", "credit", "Oe2hT7xN4qIa9Vb0"),
            TestToken::Visa
            | TestToken::ProcessorTimeoutAfterCapture
            | TestToken::ProcessorUnavailable
            | TestToken::RefundFail => VISA,
        }
    }

    /// The decline this card always gets; `None` for cards that pay. The
    /// codes are those of Stripe's table of declining test cards.
    pub fn decline(self) -> Option<Decline> {
        // Declined by the issuer, for `reason`: `card_declined`, the reason
        // given as the `decline_code`.
        let card_declined = |reason, message| {
            Some(Decline {
                code: "card_declined",
                decline_code: Some(reason),
                reason,
                param: None,
                message,
            })
        };
        // A decline with a code of its own: no `decline_code`.
        let own_code = |code, param, message| {
            Some(Decline {
                code,
                decline_code: None,
                reason: code,
                param,
                message,
            })
        };
        match self {
            TestToken::Visa
            | TestToken::VisaDebit
            | TestToken::Mastercard
            | TestToken::MastercardDebit
            | TestToken::Amex
            | TestToken::Discover
            | TestToken::MastercardPrepaid
            | TestToken::Jcb
            | TestToken::UnionPay
            | TestToken::Diners
            | TestToken::RiskLevelElevated
            | TestToken::ProcessorTimeoutAfterCapture
            | TestToken::ProcessorUnavailable
            | TestToken::RefundFail => None,
            TestToken::Declined => card_declined("generic_decline", DECLINED),
            TestToken::DeclinedInsufficientFunds => {
                card_declined("insufficient_funds", "Your card has insufficient funds.")
            }
            TestToken::DeclinedExpiredCard => {
                own_code("expired_card", Some("exp_month"), "Your card has expired.")
            }
            TestToken::DeclinedIncorrectCvc => own_code(
                "incorrect_cvc",
                Some("cvc"),
                "Your card's security code is incorrect.",
            ),
            TestToken::DeclinedProcessingError => own_code(
                "processing_error",
                None,
                "An error occurred while processing your card. Try again in a little bit.",
            ),
            TestToken::DeclinedFraudulent => card_declined("fraudulent", DECLINED),
            TestToken::DeclinedLostCard => card_declined("lost_card", DECLINED),
            TestToken::DeclinedStolenCard => card_declined("stolen_card", DECLINED),
        }
    }

    /// What the charge's `outcome` says: authorized (or, at an elevated
    /// risk, authorized and placed in review), declined by the issuer (for
    /// its reason), or blocked as fraud before the network saw it.
    pub fn verdict(self) -> Verdict {
        match self.decline() {
            None if self == TestToken::RiskLevelElevated => Verdict {
                kind: "manual_review",
                network_status: "approved_by_network",
                reason: Some("elevated_risk_level"),
                risk_level: "elevated",
                seller_message: "Stripe evaluated this payment as having elevated risk, and placed it in your manual review queue.",
            },
            None => Verdict {
                kind: "authorized",
                network_status: "approved_by_network",
                reason: None,
                risk_level: "normal",
                seller_message: "Payment complete.",
            },
            Some(_) if self == TestToken::DeclinedFraudulent => Verdict {
                kind: "blocked",
                network_status: "not_sent_to_network",
                reason: Some("highest_risk_level"),
                risk_level: "highest",
                seller_message: "Stripe blocked this payment as too risky.",
            },
            Some(decline) => Verdict {
                kind: "issuer_declined",
                network_status: "declined_by_network",
                reason: Some(decline.reason),
                risk_level: "normal",
                seller_message: decline_seller_message(decline.reason),
            },
        }
    }

    /// The card's CVC check: `fail` for the card declined for its CVC,
    /// `pass` for every other.
    pub fn cvc_check(self) -> &'static str {
        if self == TestToken::DeclinedIncorrectCvc {
            "fail"
        } else {
            "pass"
        }
    }

    /// The message shown for a failure code; for `card_declined`, whose
    /// cards differ, the generic one (a card's own is its [`Decline`]'s).
    pub fn decline_message(code: &str) -> &'static str {
        ALL.iter()
            .filter_map(|(t, _)| t.decline())
            .find(|d| d.code == code)
            .map_or(DECLINED, |d| d.message)
    }
}

/// A token's name after its `tok_`: the card's name in its payment method's.
fn card_name(token: &str) -> &str {
    token.split_once('_').map_or(token, |(_, card)| card)
}

/// Stripe's seller message for an issuer's reason.
fn decline_seller_message(reason: &str) -> &'static str {
    match reason {
        "insufficient_funds" => "The bank returned the decline code `insufficient_funds`.",
        "expired_card" => "The bank returned the decline code `expired_card`.",
        "incorrect_cvc" => "The bank returned the decline code `incorrect_cvc`.",
        "processing_error" => "The bank returned the decline code `processing_error`.",
        "lost_card" => "The bank returned the decline code `lost_card`.",
        "stolen_card" => "The bank returned the decline code `stolen_card`.",
        _ => "The bank did not return any further details with this decline.",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_token_round_trips_by_name() {
        for (token, name) in ALL {
            assert_eq!(TestToken::parse(name), Some(token));
            assert_eq!(token.as_str(), name);
        }
        assert_eq!(TestToken::parse("tok_VISA"), None);
    }

    #[test]
    fn stripes_test_payment_methods_name_the_same_cards() {
        assert_eq!(TestToken::parse("pm_card_visa"), Some(TestToken::Visa));
        assert_eq!(
            TestToken::parse("pm_card_mastercard_prepaid"),
            Some(TestToken::MastercardPrepaid)
        );
        assert_eq!(
            TestToken::parse("pm_card_chargeDeclinedInsufficientFunds"),
            Some(TestToken::DeclinedInsufficientFunds)
        );
        assert_eq!(TestToken::parse("pm_card_processorUnavailable"), None);
        assert_eq!(TestToken::parse("pm_card_"), None);
        assert_eq!(TestToken::parse("pm_visa"), None);
        for token in TestToken::all() {
            match token.payment_method() {
                Some(name) => assert_eq!(TestToken::parse(&name), Some(token)),
                None => assert!(!token.has_payment_method()),
            }
        }
    }

    #[test]
    fn declines_follow_stripes_table() {
        let codes = |token: TestToken| {
            let d = token.decline().unwrap();
            (d.code, d.decline_code, d.param)
        };
        let declined = |reason| ("card_declined", Some(reason), None);
        assert_eq!(codes(TestToken::Declined), declined("generic_decline"));
        assert_eq!(
            codes(TestToken::DeclinedInsufficientFunds),
            declined("insufficient_funds")
        );
        assert_eq!(codes(TestToken::DeclinedFraudulent), declined("fraudulent"));
        assert_eq!(codes(TestToken::DeclinedLostCard), declined("lost_card"));
        assert_eq!(
            codes(TestToken::DeclinedStolenCard),
            declined("stolen_card")
        );
        assert_eq!(
            codes(TestToken::DeclinedExpiredCard),
            ("expired_card", None, Some("exp_month"))
        );
        assert_eq!(
            codes(TestToken::DeclinedIncorrectCvc),
            ("incorrect_cvc", None, Some("cvc"))
        );
        assert_eq!(
            codes(TestToken::DeclinedProcessingError),
            ("processing_error", None, None)
        );
        assert_eq!(TestToken::RiskLevelElevated.decline(), None);
        assert_eq!(
            TestToken::RiskLevelElevated.verdict().risk_level,
            "elevated"
        );
    }

    #[test]
    fn every_decline_reason_has_its_own_seller_message() {
        for token in TestToken::all() {
            if let Some(decline) = token.decline() {
                let verdict = token.verdict();
                assert_ne!(verdict.kind, "authorized", "{token:?}");
                if verdict.kind == "issuer_declined" && decline.reason != "generic_decline" {
                    assert!(verdict.seller_message.contains(decline.reason), "{token:?}");
                }
            }
        }
    }
}
