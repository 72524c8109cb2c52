//! The test card tokens, with Stripe's names, and what each card does.
//!
//! The one module both systems read: oncepay accepts these names as a
//! charge's `source` (and refuses any other, as it always has), and the card
//! gateway (`crate::gateway`) decides each authorization's and refund's
//! outcome from them. Like a real gateway's published test cards, the table
//! is a contract both sides know, not code of either; it imports nothing.

/// A test card token accepted as a charge `source`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestToken {
    Visa,
    Mastercard,
    Amex,
    Declined,
    DeclinedInsufficientFunds,
    DeclinedExpiredCard,
    /// The processor records the payment, then the call times out.
    ProcessorTimeoutAfterCapture,
    /// The processor records nothing and the call fails at once.
    ProcessorUnavailable,
    /// The payment succeeds; the first refund of it is refused by the card's
    /// issuer, for good. Later refunds of the same charge go through.
    RefundFail,
}

const ALL: [(TestToken, &str); 9] = [
    (TestToken::Visa, "tok_visa"),
    (TestToken::Mastercard, "tok_mastercard"),
    (TestToken::Amex, "tok_amex"),
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
        TestToken::ProcessorTimeoutAfterCapture,
        "tok_processorTimeoutAfterCapture",
    ),
    (TestToken::ProcessorUnavailable, "tok_processorUnavailable"),
    (TestToken::RefundFail, "tok_refundFail"),
];

impl TestToken {
    /// Accepts a token by its exact name.
    pub fn parse(name: &str) -> Option<Self> {
        ALL.iter().find(|(_, n)| *n == name).map(|(t, _)| *t)
    }

    pub fn as_str(self) -> &'static str {
        ALL.iter()
            .find(|(t, _)| *t == self)
            .map(|(_, n)| *n)
            .expect("every token is listed")
    }

    /// The decline this card always gets, as (code, message); `None` for cards that pay.
    pub fn decline(self) -> Option<(&'static str, &'static str)> {
        match self {
            TestToken::Visa
            | TestToken::Mastercard
            | TestToken::Amex
            | TestToken::ProcessorTimeoutAfterCapture
            | TestToken::ProcessorUnavailable
            | TestToken::RefundFail => None,
            TestToken::Declined => Some(("card_declined", "Your card was declined.")),
            TestToken::DeclinedInsufficientFunds => {
                Some(("insufficient_funds", "Your card has insufficient funds."))
            }
            TestToken::DeclinedExpiredCard => Some(("expired_card", "Your card has expired.")),
        }
    }

    /// The message shown for a decline code.
    pub fn decline_message(code: &str) -> &'static str {
        ALL.iter()
            .filter_map(|(t, _)| t.decline())
            .find(|(c, _)| *c == code)
            .map_or("Your card was declined.", |(_, m)| m)
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
}
