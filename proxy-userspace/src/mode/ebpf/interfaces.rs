//! Which interfaces get which programs, found and watched over rtnetlink.
//!
//! Uplinks are the interfaces named with `--interface`, or else those that
//! carry a node IP. Pod interfaces are every other veth: the node's end of
//! a pod's veth pair, whatever CNI made it; new ones are picked up as they
//! appear.

use std::net::{IpAddr, Ipv4Addr};

use anyhow::{Context, Result, bail};
use futures_util::{StreamExt, TryStreamExt};
use rtnetlink::{
    Handle, MulticastGroup,
    packet_core::NetlinkPayload,
    packet_route::{
        RouteNetlinkMessage,
        address::AddressAttribute,
        link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage},
    },
};
use tokio::sync::mpsc;

/// A named uplink that is not there (its own type, so the CLI can exit
/// with a distinct code).
#[derive(Debug, thiserror::Error)]
#[error("interface {0} does not exist")]
pub struct MissingInterface(pub String);

/// An interface as far as attaching programs is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    pub index: u32,
    pub name: String,
    pub is_veth: bool,
    /// The other end of the link is in another network namespace (a
    /// veth's peer in a pod): the kernel names that namespace
    /// (IFLA_LINK_NETNSID) only then.
    pub peer_elsewhere: bool,
    pub ipv4: Vec<Ipv4Addr>,
}

fn interface_of(msg: &LinkMessage) -> Option<Interface> {
    let mut name = None;
    let mut is_veth = false;
    let mut peer_elsewhere = false;
    for attr in &msg.attributes {
        match attr {
            LinkAttribute::IfName(n) => name = Some(n.clone()),
            LinkAttribute::LinkNetNsId(_) => peer_elsewhere = true,
            LinkAttribute::LinkInfo(infos) => {
                is_veth = infos.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth)));
            }
            _ => {}
        }
    }
    Some(Interface {
        index: msg.header.index,
        name: name?,
        is_veth,
        peer_elsewhere,
        ipv4: Vec::new(),
    })
}

/// Every interface of the current network namespace with its IPv4 addresses.
pub async fn list(handle: &Handle) -> Result<Vec<Interface>> {
    let mut interfaces: Vec<Interface> = handle
        .link()
        .get()
        .execute()
        .map_ok(|msg| interface_of(&msg))
        .try_filter_map(|i| async move { Ok(i) })
        .try_collect()
        .await
        .context("listing links over rtnetlink")?;
    let mut addrs = handle.address().get().execute();
    while let Some(msg) = addrs.try_next().await.context("listing addresses over rtnetlink")? {
        let Some(iface) = interfaces.iter_mut().find(|i| i.index == msg.header.index) else {
            continue;
        };
        for attr in &msg.attributes {
            if let AddressAttribute::Local(IpAddr::V4(ip)) | AddressAttribute::Address(IpAddr::V4(ip)) = attr
                && !iface.ipv4.contains(ip)
            {
                iface.ipv4.push(*ip);
            }
        }
    }
    Ok(interfaces)
}

/// The uplinks: the named interfaces (which must exist), else those
/// carrying one of `node_ips`.
pub fn uplinks(all: &[Interface], named: &[String], node_ips: &[Ipv4Addr]) -> Result<Vec<Interface>> {
    if !named.is_empty() {
        return named
            .iter()
            .map(|n| {
                all.iter()
                    .find(|i| &i.name == n)
                    .cloned()
                    .ok_or_else(|| MissingInterface(n.clone()).into())
            })
            .collect();
    }
    let found: Vec<Interface> = all
        .iter()
        .filter(|i| i.ipv4.iter().any(|ip| node_ips.contains(ip)))
        .cloned()
        .collect();
    if found.is_empty() {
        bail!("no interface carries a node IP ({node_ips:?}); name the uplinks with --interface");
    }
    Ok(found)
}

/// The node's ends of pod veths: every veth that is not an uplink.
pub fn pod_interfaces(all: &[Interface], uplinks: &[Interface]) -> Vec<Interface> {
    all.iter()
        .filter(|i| i.is_veth && !uplinks.iter().any(|u| u.index == i.index))
        .cloned()
        .collect()
}

/// Sends every veth that appears from now on (RTM_NEWLINK), until the
/// receiver is dropped. A link seen again (a flag change) is sent again;
/// the receiver decides what is new.
pub fn watch_new_veths() -> Result<mpsc::UnboundedReceiver<Interface>> {
    let (conn, _handle, mut messages) =
        rtnetlink::new_multicast_connection(&[MulticastGroup::Link]).context("subscribing to link events")?;
    tokio::spawn(conn);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some((msg, _)) = messages.next().await {
            if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) = msg.payload
                && let Some(iface) = interface_of(&link)
                && iface.is_veth
                && tx.send(iface).is_err()
            {
                break;
            }
        }
    });
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(index: u32, name: &str, is_veth: bool, ip: Option<[u8; 4]>) -> Interface {
        Interface {
            index,
            name: name.into(),
            is_veth,
            peer_elsewhere: is_veth,
            ipv4: ip.map(Ipv4Addr::from).into_iter().collect(),
        }
    }

    #[test]
    fn uplinks_come_from_flags_or_node_ips_and_pods_are_the_other_veths() {
        let all = vec![
            iface(1, "lo", false, Some([127, 0, 0, 1])),
            iface(2, "eth0", true, Some([192, 168, 1, 10])),
            iface(3, "lxc1", true, None),
            iface(4, "cni0", false, Some([10, 244, 0, 1])),
        ];
        let by_ip = uplinks(&all, &[], &[Ipv4Addr::new(192, 168, 1, 10)]).unwrap();
        assert_eq!(by_ip.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(), ["eth0"]);
        let named = uplinks(&all, &["cni0".into()], &[]).unwrap();
        assert_eq!(named[0].index, 4);
        assert!(
            uplinks(&all, &["nope".into()], &[])
                .unwrap_err()
                .to_string()
                .contains("nope")
        );
        assert!(uplinks(&all, &[], &[Ipv4Addr::new(1, 2, 3, 4)]).is_err());
        let pods = pod_interfaces(&all, &by_ip);
        assert_eq!(pods.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(), ["lxc1"]);
    }
}
