//! The webhook address guard: an endpoint may not point inside the network.
//!
//! An address is refused when it is, or resolves to, anything but a public
//! unicast address (the list is [`Network`]; `docs/webhooks.md` has it as a
//! table). The check runs when an endpoint is created
//! ([`AddressGuard::check_url`], for an early `400 url_invalid`) and again
//! at every attempt, where it is what counts:
//! the delivery client resolves names through [`GuardedResolver`], which
//! refuses the whole answer if any address in it is refused, and connects
//! only to the addresses it checked (no second lookup between the check and
//! the connection). An IP address written in the URL is never looked up, so
//! [`AddressGuard::check_literal`] checks it before the attempt is sent.
//!
//! `WEBHOOK_ALLOW_PRIVATE=true` turns the guard off, for a receiver running
//! beside the service (the workshop, the tests).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use url::{Host, Url};

/// How long the check at creation waits for a name to resolve. A name that
/// does not resolve in time is accepted there: the attempts check it again.
const CREATION_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// The kind of network a refused address belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Network {
    /// `0.0.0.0`, `::`.
    Unspecified,
    /// `0.0.0.0/8`: "this network".
    ThisNetwork,
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// `10.0.0.0/8`, `172.16.0.0/12`, `192.168.0.0/16`.
    Private,
    /// `100.64.0.0/10`: carrier-grade NAT.
    SharedAddressSpace,
    /// `169.254.0.0/16` (cloud metadata lives there), `fe80::/10`.
    LinkLocal,
    /// `fc00::/7`.
    UniqueLocal,
    /// `fec0::/10`, deprecated but still routed by some networks.
    SiteLocal,
    /// `224.0.0.0/4`, `ff00::/8`.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// `192.0.2.0/24`, `198.51.100.0/24`, `203.0.113.0/24`, `2001:db8::/32`,
    /// `3fff::/20`.
    Documentation,
    /// `198.18.0.0/15`.
    Benchmarking,
    /// `192.0.0.0/24` and `2001::/23`: protocol assignments (Teredo among
    /// them, whose addresses hide an IPv4 address).
    ProtocolAssignments,
    /// `240.0.0.0/4`, `192.88.99.0/24`, and IPv6 outside global unicast
    /// `2000::/3` (IPv4-compatible `::a.b.c.d`, discard-only `100::/64`,
    /// local-use NAT64 `64:ff9b:1::/48`, ...).
    Reserved,
}

impl Network {
    /// How a message names it: "a loopback address".
    pub fn describe(self) -> &'static str {
        match self {
            Network::Unspecified => "the unspecified address",
            Network::ThisNetwork => "an address of \"this network\" (0.0.0.0/8)",
            Network::Loopback => "a loopback address",
            Network::Private => "a private address",
            Network::SharedAddressSpace => "a carrier-grade NAT address (100.64.0.0/10)",
            Network::LinkLocal => "a link-local address",
            Network::UniqueLocal => "a unique-local address",
            Network::SiteLocal => "a site-local address",
            Network::Multicast => "a multicast address",
            Network::Broadcast => "the broadcast address",
            Network::Documentation => "a documentation address",
            Network::Benchmarking => "a benchmarking address",
            Network::ProtocolAssignments => "a protocol-assignment address",
            Network::Reserved => "a reserved address",
        }
    }
}

/// Why an address may not receive webhooks, or `None` when it is a public
/// unicast address. IPv4-mapped IPv6 (`::ffff:a.b.c.d`) is judged as the
/// IPv4 address it is; NAT64 (`64:ff9b::/96`) and 6to4 (`2002::/16`)
/// addresses as the IPv4 address they lead to.
///
/// std's stable `is_*` methods decide what they can; the ranges whose
/// methods are not stable (`is_shared`, `is_benchmarking`, `is_reserved`,
/// `is_global`) are written out here.
pub fn refused_network(ip: IpAddr) -> Option<Network> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => refused_v6(v6),
    }
}

fn refused_v4(ip: Ipv4Addr) -> Option<Network> {
    let [a, b, c, _] = ip.octets();
    let network = if ip.is_unspecified() {
        Network::Unspecified
    } else if a == 0 {
        Network::ThisNetwork
    } else if ip.is_loopback() {
        Network::Loopback
    } else if ip.is_private() {
        Network::Private
    } else if ip.is_link_local() {
        Network::LinkLocal
    } else if ip.is_broadcast() {
        Network::Broadcast
    } else if ip.is_multicast() {
        Network::Multicast
    } else if ip.is_documentation() {
        Network::Documentation
    } else if a == 100 && b & 0b1100_0000 == 64 {
        Network::SharedAddressSpace
    } else if a == 198 && b & 0b1111_1110 == 18 {
        Network::Benchmarking
    } else if a == 192 && b == 0 && c == 0 {
        Network::ProtocolAssignments
    } else if a >= 240 || (a == 192 && b == 88 && c == 99) {
        Network::Reserved
    } else {
        return None;
    };
    Some(network)
}

fn refused_v6(ip: Ipv6Addr) -> Option<Network> {
    let segments = ip.segments();
    let network = if ip.is_unspecified() {
        Network::Unspecified
    } else if ip.is_loopback() {
        Network::Loopback
    } else if ip.is_multicast() {
        Network::Multicast
    } else if ip.is_unique_local() {
        Network::UniqueLocal
    } else if ip.is_unicast_link_local() {
        Network::LinkLocal
    } else if segments[0] & 0xffc0 == 0xfec0 {
        Network::SiteLocal
    } else if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        // NAT64: the gateway connects to the IPv4 address in the last 32 bits.
        return refused_v4(embedded_v4(segments[6], segments[7]));
    } else if segments[0] == 0x2002 {
        // 6to4: the relay connects to the IPv4 address after the prefix.
        return refused_v4(embedded_v4(segments[1], segments[2]));
    } else if (segments[0] == 0x2001 && segments[1] == 0x0db8) || segments[0] & 0xfff0 == 0x3ff0 {
        Network::Documentation
    } else if segments[0] == 0x2001 && segments[1] < 0x0200 {
        Network::ProtocolAssignments
    } else if segments[0] & 0xe000 != 0x2000 {
        Network::Reserved
    } else {
        return None;
    };
    Some(network)
}

fn embedded_v4(high: u16, low: u16) -> Ipv4Addr {
    Ipv4Addr::from((u32::from(high) << 16) | u32::from(low))
}

/// An address the guard refused. Its message names the kind of network,
/// never the URL (which may carry a merchant's token) nor the address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("address not allowed: the host is {}", .0.describe())]
    Address(Network),
    #[error("address not allowed: the host resolves to {}", .0.describe())]
    Resolved(Network),
}

impl Refused {
    /// The kind of network the refused address belongs to.
    pub fn network(self) -> Network {
        match self {
            Refused::Address(n) | Refused::Resolved(n) => n,
        }
    }

    /// Finds a refusal in an error's chain of sources (as reqwest wraps
    /// what the resolver returned).
    pub fn in_chain(error: &(dyn std::error::Error + 'static)) -> Option<Refused> {
        let mut current = Some(error);
        while let Some(e) = current {
            if let Some(refused) = e.downcast_ref::<Refused>() {
                return Some(*refused);
            }
            current = e.source();
        }
        None
    }
}

/// The first refused address among `addrs`, judged as a whole: one bad
/// address refuses the name, since the connection may go to any of them.
fn first_refused(addrs: impl IntoIterator<Item = IpAddr>) -> Option<Network> {
    addrs.into_iter().find_map(refused_network)
}

/// The guard, on or off (`WEBHOOK_ALLOW_PRIVATE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressGuard {
    allow_private: bool,
}

impl AddressGuard {
    pub fn new(allow_private: bool) -> Self {
        AddressGuard { allow_private }
    }

    /// Whether the guard checks anything.
    pub fn is_on(self) -> bool {
        !self.allow_private
    }

    /// Checks an IP address written in `url` (one that is never looked up);
    /// a name is left to [`GuardedResolver`]. An unparsable URL is left to
    /// the client, which fails it.
    pub fn check_literal(self, url: &str) -> Result<(), Refused> {
        if !self.is_on() {
            return Ok(());
        }
        match Url::parse(url).ok().as_ref().and_then(Url::host) {
            Some(Host::Ipv4(v4)) => refused_v4_or_mapped(IpAddr::V4(v4)),
            Some(Host::Ipv6(v6)) => refused_v4_or_mapped(IpAddr::V6(v6)),
            _ => Ok(()),
        }
    }

    /// The check when an endpoint is created: an address in the URL is
    /// judged at once, a name after looking it up. A name that does not
    /// resolve (yet), or not within a few seconds, is accepted: it may be
    /// set up later, and every attempt resolves and checks it again.
    pub async fn check_url(self, url: &str) -> Result<(), Refused> {
        if !self.is_on() {
            return Ok(());
        }
        self.check_literal(url)?;
        let name = Url::parse(url).ok().and_then(|u| match u.host() {
            Some(Host::Domain(name)) => Some(name.to_owned()),
            _ => None,
        });
        let Some(name) = name else {
            return Ok(());
        };
        match tokio::time::timeout(CREATION_LOOKUP_TIMEOUT, lookup(&name)).await {
            Ok(Ok(addrs)) => match first_refused(addrs.iter().map(SocketAddr::ip)) {
                Some(network) => Err(Refused::Resolved(network)),
                None => Ok(()),
            },
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "a webhook endpoint's host did not resolve");
                Ok(())
            }
            Err(_) => {
                tracing::debug!("a webhook endpoint's host did not resolve in time");
                Ok(())
            }
        }
    }
}

fn refused_v4_or_mapped(ip: IpAddr) -> Result<(), Refused> {
    match refused_network(ip) {
        Some(network) => Err(Refused::Address(network)),
        None => Ok(()),
    }
}

/// The system's resolver (`getaddrinfo`, on a blocking thread), port 0.
async fn lookup(name: &str) -> std::io::Result<Vec<SocketAddr>> {
    Ok(tokio::net::lookup_host((name, 0)).await?.collect())
}

/// The delivery client's resolver with the guard on: resolves a name with
/// the system's resolver and hands reqwest the addresses only if none is
/// refused, so the connection goes to an address that was checked.
#[derive(Clone, Copy, Debug, Default)]
pub struct GuardedResolver;

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let name = name.as_str().to_owned();
        Box::pin(async move {
            let addrs = lookup(&name).await?;
            if let Some(network) = first_refused(addrs.iter().map(SocketAddr::ip)) {
                return Err(Box::new(Refused::Resolved(network)) as _);
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn network(ip: &str) -> Option<Network> {
        refused_network(ip.parse().unwrap())
    }

    #[test]
    fn loopback_private_link_local_and_unspecified_ipv4_addresses_are_refused() {
        for (ip, expected) in [
            ("127.0.0.1", Network::Loopback),
            ("127.255.255.254", Network::Loopback),
            ("10.0.0.1", Network::Private),
            ("10.255.255.255", Network::Private),
            ("172.16.0.1", Network::Private),
            ("172.31.255.255", Network::Private),
            ("192.168.1.1", Network::Private),
            ("169.254.169.254", Network::LinkLocal),
            ("100.64.0.1", Network::SharedAddressSpace),
            ("100.127.255.255", Network::SharedAddressSpace),
            ("0.0.0.0", Network::Unspecified),
            ("0.1.2.3", Network::ThisNetwork),
            ("224.0.0.1", Network::Multicast),
            ("239.255.255.250", Network::Multicast),
            ("255.255.255.255", Network::Broadcast),
            ("192.0.2.1", Network::Documentation),
            ("198.51.100.7", Network::Documentation),
            ("203.0.113.9", Network::Documentation),
            ("198.18.0.1", Network::Benchmarking),
            ("198.19.255.255", Network::Benchmarking),
            ("192.0.0.8", Network::ProtocolAssignments),
            ("192.88.99.1", Network::Reserved),
            ("240.0.0.1", Network::Reserved),
        ] {
            assert_eq!(network(ip), Some(expected), "{ip}");
        }
    }

    #[test]
    fn public_ipv4_addresses_next_to_the_refused_ranges_are_allowed() {
        for ip in [
            "93.184.215.14",
            "8.8.8.8",
            "1.1.1.1",
            "9.255.255.255",
            "11.0.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.167.255.255",
            "192.169.0.0",
            "169.253.255.255",
            "100.63.255.255",
            "100.128.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "198.17.255.255",
            "198.20.0.0",
            "192.0.1.1",
            "223.255.255.255",
        ] {
            assert_eq!(network(ip), None, "{ip}");
        }
    }

    #[test]
    fn ipv6_loopback_unique_local_link_local_multicast_and_unspecified_are_refused() {
        for (ip, expected) in [
            ("::1", Network::Loopback),
            ("::", Network::Unspecified),
            ("fc00::1", Network::UniqueLocal),
            ("fd12:3456:789a::1", Network::UniqueLocal),
            ("fe80::1", Network::LinkLocal),
            ("febf:ffff::1", Network::LinkLocal),
            ("fec0::1", Network::SiteLocal),
            ("ff02::1", Network::Multicast),
            ("ff05::1:3", Network::Multicast),
            ("2001:db8::1", Network::Documentation),
            ("3fff::1", Network::Documentation),
            ("2001::1", Network::ProtocolAssignments),
            ("2001:2::1", Network::ProtocolAssignments),
            ("100::1", Network::Reserved),
            ("::7f00:1", Network::Reserved),
            ("64:ff9b:1::1", Network::Reserved),
            ("4000::1", Network::Reserved),
        ] {
            assert_eq!(network(ip), Some(expected), "{ip}");
        }
    }

    #[test]
    fn ipv4_addresses_inside_ipv6_are_judged_as_the_ipv4_address_they_reach() {
        for (ip, expected) in [
            ("::ffff:127.0.0.1", Some(Network::Loopback)),
            ("::ffff:10.0.0.1", Some(Network::Private)),
            ("::ffff:169.254.169.254", Some(Network::LinkLocal)),
            ("::ffff:0.0.0.0", Some(Network::Unspecified)),
            ("::ffff:93.184.215.14", None),
            ("64:ff9b::127.0.0.1", Some(Network::Loopback)),
            ("64:ff9b::192.168.0.1", Some(Network::Private)),
            ("64:ff9b::93.184.215.14", None),
            ("2002:7f00:1::1", Some(Network::Loopback)),
            ("2002:a9fe:a9fe::1", Some(Network::LinkLocal)),
            ("2002:5db8:d70e::1", None),
        ] {
            assert_eq!(network(ip), expected, "{ip}");
        }
    }

    #[test]
    fn public_ipv6_addresses_are_allowed() {
        for ip in [
            "2606:2800:21f:cb07:6820:80da:af6b:8b2c",
            "2001:4860:4860::8888",
            "2a00:1450:4001:82b::200e",
            "2001:200::1",
        ] {
            assert_eq!(network(ip), None, "{ip}");
        }
    }

    #[test]
    fn an_address_in_the_url_is_refused_however_it_is_written_and_only_with_the_guard_on() {
        let on = AddressGuard::new(false);
        for (url, expected) in [
            ("http://127.0.0.1:9/x", Network::Loopback),
            ("http://2130706433/", Network::Loopback),
            ("http://0x7f.1/", Network::Loopback),
            ("http://[::1]:8080/", Network::Loopback),
            ("http://[::ffff:10.0.0.1]/", Network::Private),
            (
                "https://169.254.169.254/latest/meta-data/",
                Network::LinkLocal,
            ),
            ("http://[fe80::1]/", Network::LinkLocal),
            ("http://0.0.0.0:80/", Network::Unspecified),
        ] {
            assert_eq!(
                on.check_literal(url),
                Err(Refused::Address(expected)),
                "{url}"
            );
        }
        assert_eq!(on.check_literal("https://93.184.215.14/hooks"), Ok(()));
        assert_eq!(on.check_literal("https://example.com/hooks"), Ok(()));
        let off = AddressGuard::new(true);
        assert_eq!(off.check_literal("http://127.0.0.1:9/x"), Ok(()));
    }

    #[test]
    fn a_refusal_is_found_through_the_errors_that_wrap_it_and_names_no_address() {
        /// An error wrapping another, as hyper and reqwest wrap the resolver's.
        #[derive(Debug, thiserror::Error)]
        #[error("dns error")]
        struct Wrapper(#[source] Box<dyn std::error::Error + Send + Sync>);

        let refused = Refused::Resolved(Network::Loopback);
        let wrapped = Wrapper(Box::new(Wrapper(Box::new(refused))));
        assert_eq!(Refused::in_chain(&wrapped), Some(refused));
        let plain = Wrapper(Box::new(std::io::Error::other("connection refused")));
        assert_eq!(Refused::in_chain(&plain), None);
        assert_eq!(
            refused.to_string(),
            "address not allowed: the host resolves to a loopback address"
        );
    }
}
