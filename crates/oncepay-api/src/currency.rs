//! ISO 4217 currency codes, and the least a charge may be in each.

use crate::amount::Amount;
use crate::params::ParamError;
use crate::problem::ProblemCode;

/// The active ISO 4217 alphabetic codes, in lower case (fund and precious
/// metal codes left out).
const CODES: &[&str] = &[
    "aed", "afn", "all", "amd", "ang", "aoa", "ars", "aud", "awg", "azn", "bam", "bbd", "bdt",
    "bgn", "bhd", "bif", "bmd", "bnd", "bob", "brl", "bsd", "btn", "bwp", "byn", "bzd", "cad",
    "cdf", "chf", "clp", "cny", "cop", "crc", "cuc", "cup", "cve", "czk", "djf", "dkk", "dop",
    "dzd", "egp", "ern", "etb", "eur", "fjd", "fkp", "gbp", "gel", "ghs", "gip", "gmd", "gnf",
    "gtq", "gyd", "hkd", "hnl", "htg", "huf", "idr", "ils", "inr", "iqd", "irr", "isk", "jmd",
    "jod", "jpy", "kes", "kgs", "khr", "kmf", "kpw", "krw", "kwd", "kyd", "kzt", "lak", "lbp",
    "lkr", "lrd", "lsl", "lyd", "mad", "mdl", "mga", "mkd", "mmk", "mnt", "mop", "mru", "mur",
    "mvr", "mwk", "mxn", "myr", "mzn", "nad", "ngn", "nio", "nok", "npr", "nzd", "omr", "pab",
    "pen", "pgk", "php", "pkr", "pln", "pyg", "qar", "ron", "rsd", "rub", "rwf", "sar", "sbd",
    "scr", "sdg", "sek", "sgd", "shp", "sle", "sll", "sos", "srd", "ssp", "stn", "svc", "syp",
    "szl", "thb", "tjs", "tmt", "tnd", "top", "try", "ttd", "twd", "tzs", "uah", "ugx", "usd",
    "uyu", "uzs", "ves", "vnd", "vuv", "wst", "xaf", "xcd", "xcg", "xof", "xpf", "yer", "zar",
    "zmw", "zwg", "zwl",
];

/// The least a charge may be in the currencies Stripe documents a minimum
/// for, in minor units: 0.50 USD, and about as much in each of the others
/// (<https://stripe.com/docs/currencies#minimum-and-maximum-charge-amounts>).
/// Sorted by code.
const MINIMUM_CHARGES: &[(&str, i64)] = &[
    ("aed", 200),
    ("aud", 50),
    ("bgn", 100),
    ("brl", 50),
    ("cad", 50),
    ("chf", 50),
    ("czk", 1500),
    ("dkk", 250),
    ("eur", 50),
    ("gbp", 30),
    ("hkd", 400),
    ("huf", 17500),
    ("inr", 50),
    ("jpy", 50),
    ("mxn", 1000),
    ("myr", 200),
    ("nok", 300),
    ("nzd", 50),
    ("pln", 200),
    ("ron", 200),
    ("sek", 300),
    ("sgd", 50),
    ("thb", 1000),
    ("usd", 50),
];

/// The currencies of [`MINIMUM_CHARGES`] without minor units.
const ZERO_DECIMAL: &[&str] = &["jpy"];

/// A known currency, stored in lower case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Currency(String);

impl Currency {
    /// Accepts a known ISO 4217 code in any case.
    pub fn parse(code: &str) -> Option<Self> {
        let lower = code.to_ascii_lowercase();
        CODES
            .binary_search(&lower.as_str())
            .ok()
            .map(|_| Currency(lower))
    }

    /// The code, in lower case.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The least a charge in this currency may be, in minor units, where
    /// Stripe documents one (none for the other currencies).
    pub fn minimum_charge(&self) -> Option<i64> {
        MINIMUM_CHARGES
            .binary_search_by(|(code, _)| code.cmp(&self.as_str()))
            .ok()
            .map(|at| MINIMUM_CHARGES[at].1)
    }

    /// `amount_too_small` when `amount` is less than a charge in this
    /// currency may be, with Stripe's message ("Amount must be at least 50
    /// cents", or the minimum in the currency's own units).
    pub fn check_charge(&self, amount: Amount) -> Result<(), ParamError> {
        let Some(minimum) = self.minimum_charge() else {
            return Ok(());
        };
        if amount.minor_units() >= minimum {
            return Ok(());
        }
        let least = match self.as_str() {
            "usd" => format!("{minimum} cents"),
            code if ZERO_DECIMAL.contains(&code) => format!("{minimum} {code}"),
            code => format!("{}.{:02} {code}", minimum / 100, minimum % 100),
        };
        Err(ParamError::new(
            ProblemCode::AmountTooSmall,
            "amount",
            format!("Amount must be at least {least}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_list_is_sorted_for_binary_search() {
        assert!(CODES.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn the_minimums_are_sorted_known_codes() {
        assert!(MINIMUM_CHARGES.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(
            MINIMUM_CHARGES
                .iter()
                .all(|(code, _)| Currency::parse(code).is_some())
        );
    }

    #[test]
    fn a_charge_below_its_currencys_minimum_is_too_small() {
        let check = |code: &str, amount: i64| {
            Currency::parse(code)
                .unwrap()
                .check_charge(Amount::new(amount).unwrap())
                .map_err(|e| e.message)
        };
        assert_eq!(check("usd", 50), Ok(()));
        assert_eq!(
            check("usd", 49),
            Err("Amount must be at least 50 cents".into())
        );
        assert_eq!(
            check("dkk", 249),
            Err("Amount must be at least 2.50 dkk".into())
        );
        assert_eq!(
            check("jpy", 5),
            Err("Amount must be at least 50 jpy".into())
        );
        assert_eq!(check("gbp", 30), Ok(()));
        assert_eq!(check("isk", 1), Ok(()), "no documented minimum");
    }

    #[test]
    fn codes_are_accepted_in_any_case_and_stored_lower() {
        assert_eq!(Currency::parse("USD").unwrap().as_str(), "usd");
        assert_eq!(Currency::parse("eUr").unwrap().as_str(), "eur");
        assert!(Currency::parse("xyz").is_none());
        assert!(Currency::parse("us").is_none());
    }
}
