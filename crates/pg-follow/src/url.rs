//! A Postgres URL as libpq reads it, several hosts included:
//! `postgres://user:password@host1:port1,host2:port2/db?target_session_attrs=read-write`,
//! the form `pg_autoctl show uri` prints for a formation.
//!
//! sqlx's own parser takes one host only. This module splits the host list
//! off by hand and gives sqlx each host's single-host URL to parse, so that
//! every other part (user, password, percent-encoding, `sslmode`,
//! `application_name`, `options`) means exactly what it means to sqlx.

use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;

/// Which server a connection may be kept on (libpq's
/// `target_session_attrs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Any server that accepts the connection (`any`; the default with one
    /// host, as in libpq).
    Any,
    /// A server whose `transaction_read_only` is `off`: `read-write`, and
    /// `primary`, which is taken to mean the same here (a server that
    /// cannot be written to is of no use to a service that writes); also
    /// the default with several hosts, for the same reason.
    ReadWrite,
}

/// One host of the list, with everything the URL says about connecting to it.
#[derive(Clone, Debug)]
pub struct Host {
    /// `host:port`, for logs and messages (never a password).
    pub label: String,
    pub options: PgConnectOptions,
}

/// A parsed Postgres URL: its hosts, in the URL's order, and its target.
#[derive(Clone, Debug)]
pub struct PgUrl {
    hosts: Vec<Host>,
    target: Target,
    /// Whether the URL names `target_session_attrs` at all.
    target_given: bool,
}

/// Why a URL was refused; the message never repeats a password.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UrlError(String);

impl PgUrl {
    /// Parses `url`: `postgres://` or `postgresql://`, one host or a
    /// comma-separated list of `host[:port]` (each port optional), an
    /// optional `target_session_attrs` of `any`, `read-write` or `primary`
    /// (by default `any` for one host, `read-write` for several).
    pub fn parse(url: &str) -> Result<Self, UrlError> {
        let url = url.trim();
        let example = "write it like postgres://user:password@host:5432/database, \
                       or with several hosts postgres://host1:5432,host2:5432/database?target_session_attrs=read-write";
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(UrlError(format!("must be a postgres:// URL ({example})")));
        };
        if !(scheme.eq_ignore_ascii_case("postgres") || scheme.eq_ignore_ascii_case("postgresql")) {
            return Err(UrlError(format!("must be a postgres:// URL ({example})")));
        }
        let (before_query, query) = rest
            .split_once('?')
            .map_or((rest, None), |(b, q)| (b, Some(q)));
        let (authority, path) = before_query
            .split_once('/')
            .map_or((before_query, ""), |(a, p)| (a, p));
        let (userinfo, host_list) = authority
            .rsplit_once('@')
            .map_or((None, authority), |(u, h)| (Some(u), h));

        // target_session_attrs is libpq's, not sqlx's: taken out here.
        let mut target = Target::Any;
        let mut target_given = false;
        let mut kept = Vec::new();
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if name == "target_session_attrs" {
                target = match value {
                    "any" => Target::Any,
                    "read-write" | "primary" => Target::ReadWrite,
                    other => {
                        return Err(UrlError(format!(
                            "target_session_attrs={other} is not supported: oncepay writes, so \
                             it accepts read-write (or primary, taken as read-write) and any"
                        )));
                    }
                };
                target_given = true;
            } else {
                kept.push(pair);
            }
        }

        let entries: Vec<&str> = host_list.split(',').collect();
        // Several hosts and no target: read-write, not libpq's `any`. Any
        // would keep the first host that answers, a standby listed first
        // included, and a service that writes cannot use one.
        if entries.len() > 1 && !target_given {
            target = Target::ReadWrite;
        }
        if entries.len() > 1 {
            if entries.iter().any(|h| h.trim().is_empty()) {
                return Err(UrlError(format!("a host of the list is empty ({example})")));
            }
            // One list of hosts, in one place.
            for pair in &kept {
                let name = pair.split_once('=').map_or(*pair, |(n, _)| n);
                if matches!(name, "host" | "hostaddr" | "port") {
                    return Err(UrlError(format!(
                        "names several hosts and a {name} parameter: list the hosts (and \
                         their ports) before the database name only ({example})"
                    )));
                }
            }
        }
        let query = if kept.is_empty() {
            String::new()
        } else {
            format!("?{}", kept.join("&"))
        };
        let userinfo = userinfo.map_or_else(String::new, |u| format!("{u}@"));
        let hosts = entries
            .iter()
            .map(|entry| {
                let single = format!("{scheme}://{userinfo}{entry}/{path}{query}");
                let options = PgConnectOptions::from_str(&single).map_err(|e| {
                    let host = if entries.len() > 1 {
                        format!(" (host {entry})")
                    } else {
                        String::new()
                    };
                    UrlError(format!("{e}{host} ({example})"))
                })?;
                let label = format!("{}:{}", options.get_host(), options.get_port());
                Ok(Host { label, options })
            })
            .collect::<Result<Vec<_>, UrlError>>()?;
        Ok(PgUrl {
            hosts,
            target,
            target_given,
        })
    }

    /// The hosts, in the URL's order (at least one).
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Whether the URL names more than one host: only then is there a
    /// primary to follow.
    pub fn is_multi_host(&self) -> bool {
        self.hosts.len() > 1
    }

    /// Which server a connection may be kept on.
    pub fn target(&self) -> Target {
        self.target
    }

    /// Whether the URL says `target_session_attrs` at all.
    pub fn target_given(&self) -> bool {
        self.target_given
    }

    /// Every host's options with `name` as the `application_name`, unless
    /// the URL gives one.
    pub fn with_default_application_name(mut self, name: &str) -> Self {
        for host in &mut self.hosts {
            if host.options.get_application_name().is_none() {
                host.options = host.options.clone().application_name(name);
            }
        }
        self
    }
}

/// `url` with any password replaced by `***`: in the user part
/// (`user:password@`, one user for every host of a list) and in a
/// `password=` parameter.
pub fn redact(url: &str) -> String {
    let (url, query) = url
        .split_once('?')
        .map_or((url, None), |(u, q)| (u, Some(q)));
    let redacted = match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((userinfo, host)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                None => url.to_owned(),
            },
            None => url.to_owned(),
        },
        None => url.to_owned(),
    };
    match query {
        None => redacted,
        Some(query) => {
            let params: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if name.eq_ignore_ascii_case("password") => {
                        format!("{name}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{redacted}?{}", params.join("&"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(url: &PgUrl) -> Vec<&str> {
        url.hosts().iter().map(|h| h.label.as_str()).collect()
    }

    #[test]
    fn the_uri_pg_autoctl_prints_gives_each_host_in_order_and_read_write() {
        let url = PgUrl::parse(
            "postgres://127.0.0.1:6001,127.0.0.1:6002/oncepay?target_session_attrs=read-write&sslmode=prefer",
        )
        .unwrap();
        assert_eq!(labels(&url), ["127.0.0.1:6001", "127.0.0.1:6002"]);
        assert!(url.is_multi_host());
        assert_eq!(url.target(), Target::ReadWrite);
        for host in url.hosts() {
            assert_eq!(host.options.get_database(), Some("oncepay"));
            assert!(matches!(
                host.options.get_ssl_mode(),
                sqlx::postgres::PgSslMode::Prefer
            ));
        }
    }

    #[test]
    fn user_password_and_parameters_apply_to_every_host_and_ports_are_per_host() {
        let url = PgUrl::parse(
            "postgresql://app:s%40cret@db1,db2:6543,[::1]:7000/pay?application_name=fleet&sslmode=disable&target_session_attrs=any",
        )
        .unwrap();
        assert_eq!(labels(&url), ["db1:5432", "db2:6543", "[::1]:7000"]);
        assert_eq!(url.target(), Target::Any);
        assert!(url.target_given());
        for host in url.hosts() {
            assert_eq!(host.options.get_username(), "app");
            assert_eq!(host.options.get_application_name(), Some("fleet"));
            assert_eq!(host.options.get_database(), Some("pay"));
            assert!(matches!(
                host.options.get_ssl_mode(),
                sqlx::postgres::PgSslMode::Disable
            ));
        }
        // The URL's application_name wins over the default.
        let url = url.with_default_application_name("oncepay");
        assert_eq!(url.hosts()[0].options.get_application_name(), Some("fleet"));
        let plain = PgUrl::parse("postgres://db/x")
            .unwrap()
            .with_default_application_name("oncepay");
        assert_eq!(
            plain.hosts()[0].options.get_application_name(),
            Some("oncepay")
        );
    }

    #[test]
    fn a_single_host_url_is_one_host_with_no_target() {
        let url = PgUrl::parse("postgres://postgres@127.0.0.1:5432/postgres").unwrap();
        assert_eq!(labels(&url), ["127.0.0.1:5432"]);
        assert!(!url.is_multi_host());
        assert!(!url.target_given());
        assert_eq!(url.target(), Target::Any);
        let url = PgUrl::parse("postgres://db/x?target_session_attrs=primary").unwrap();
        assert_eq!(url.target(), Target::ReadWrite);
        assert!(!url.is_multi_host());
    }

    #[test]
    fn a_multi_host_url_without_target_session_attrs_targets_read_write() {
        let url = PgUrl::parse("postgres://standby:6002,primary:6001/oncepay").unwrap();
        assert!(url.is_multi_host());
        assert!(!url.target_given());
        assert_eq!(url.target(), Target::ReadWrite);
        // Said outright, `any` is still taken at its word.
        let url = PgUrl::parse("postgres://a:1,b:2/x?target_session_attrs=any").unwrap();
        assert_eq!(url.target(), Target::Any);
    }

    #[test]
    fn other_target_session_attrs_are_refused_by_name() {
        for value in ["read-only", "standby", "prefer-standby", "readwrite", ""] {
            let err = PgUrl::parse(&format!(
                "postgres://a:1,b:2/x?target_session_attrs={value}"
            ))
            .unwrap_err()
            .to_string();
            assert!(
                err.contains(&format!("target_session_attrs={value} ")),
                "{err}"
            );
            assert!(err.contains("read-write"), "{err}");
        }
    }

    #[test]
    fn malformed_host_lists_are_refused_without_the_password() {
        for bad in [
            "postgres://app:hunter2@a:1,,b:2/x",
            "postgres://app:hunter2@a:1,/x",
            "postgres://app:hunter2@a:port,b:2/x",
            "postgres://app:hunter2@a:1,b:2/x?host=c",
            "postgres://app:hunter2@a:1,b:2/x?port=5432",
            "mysql://app:hunter2@a,b/x",
            "a,b",
        ] {
            let err = PgUrl::parse(bad).unwrap_err().to_string();
            assert!(!err.contains("hunter2"), "{err}");
            assert!(err.contains("postgres://"), "{err}");
        }
    }

    #[test]
    fn passwords_are_redacted_from_multi_host_urls() {
        assert_eq!(
            redact(
                "postgres://app:hunter2@h1:6001,h2:6002/oncepay?target_session_attrs=read-write"
            ),
            "postgres://app:***@h1:6001,h2:6002/oncepay?target_session_attrs=read-write"
        );
        assert_eq!(
            redact("postgres://h1:6001,h2:6002/oncepay?password=hunter2&sslmode=prefer"),
            "postgres://h1:6001,h2:6002/oncepay?password=***&sslmode=prefer"
        );
        assert_eq!(
            redact("postgres://app@h1,h2/oncepay"),
            "postgres://app@h1,h2/oncepay"
        );
    }
}
