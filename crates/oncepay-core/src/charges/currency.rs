//! ISO 4217 currency codes.

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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_list_is_sorted_for_binary_search() {
        assert!(CODES.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn codes_are_accepted_in_any_case_and_stored_lower() {
        assert_eq!(Currency::parse("USD").unwrap().as_str(), "usd");
        assert_eq!(Currency::parse("eUr").unwrap().as_str(), "eur");
        assert!(Currency::parse("xyz").is_none());
        assert!(Currency::parse("us").is_none());
    }
}
