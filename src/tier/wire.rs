//! The peer link's messages and the gateway's settlements and refusals, each way: one function per direction,
//! so the forwarding instance's clients see the same refusal the owner's own clients would.

use std::time::Duration;

use super::proto::{self as pb, settle_reply::Outcome, settle_request::Action};
use crate::auth::Caller;
use crate::clock::Epoch;
use crate::gateway::below::{DeliveryError, Ended, NackOutcome, Resolution, Target, TransactionError};
use crate::gateway::{EndOutcome, EndRequest, GatewayError, Settle, Settled, Settlement};

/// The action's label in the tier metrics.
pub(super) fn action_label(action: &Settle) -> &'static str {
    match action {
        Settle::Ack => "ack",
        Settle::Nack { .. } => "nack",
        Settle::Term { .. } => "term",
        Settle::Extend { .. } => "extend",
    }
}

/// The request that asks the owner for `settlement`, as `caller` asked it.
pub(super) fn settle_request(caller: &Caller, settlement: Settlement<'_>, action: &Settle) -> pb::SettleRequest {
    let action = match action {
        Settle::Ack => Action::Ack(pb::Ack {}),
        Settle::Nack { delay } => Action::Nack(pb::Nack { delay_ms: delay.map(millis) }),
        Settle::Term { reason } => Action::Term(pb::Term { reason: reason.clone() }),
        Settle::Extend { by } => Action::Extend(pb::Extend { by_ms: millis(*by) }),
    };
    pb::SettleRequest {
        caller: caller.name.clone(),
        source_ip: caller.source_ip().map(|ip| ip.to_string()).unwrap_or_default(),
        delivery_id: settlement.target.id.to_owned(),
        hand_out: settlement.target.handout,
        group: settlement.group.map(str::to_owned),
        action: Some(action),
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// What a request asks of the owner: its settlement and action; `None` without an action.
pub(super) fn asked(request: &pb::SettleRequest) -> Option<(Settlement<'_>, Settle)> {
    let action = match request.action.as_ref()? {
        Action::Ack(_) => Settle::Ack,
        Action::Nack(nack) => Settle::Nack { delay: nack.delay_ms.map(Duration::from_millis) },
        Action::Term(term) => Settle::Term { reason: term.reason.clone() },
        Action::Extend(extend) => Settle::Extend { by: Duration::from_millis(extend.by_ms) },
    };
    let target = Target { id: &request.delivery_id, handout: request.hand_out };
    Some((Settlement { target, group: request.group.as_deref(), lease: None }, action))
}

/// The owner's reply: what it did, or why it refused.
pub(super) fn reply(outcome: Result<Settled, GatewayError>) -> pb::SettleReply {
    let outcome = match outcome {
        Ok(Settled::Acked) => Outcome::Acked(pb::Acked {}),
        Ok(Settled::Nacked(NackOutcome::DeadLetter)) => {
            Outcome::Nacked(pb::Nacked { dead_lettered: true, next_attempt: 0, due_ms: 0 })
        }
        Ok(Settled::Nacked(NackOutcome::Retry { attempt, due })) => {
            Outcome::Nacked(pb::Nacked { dead_lettered: false, next_attempt: attempt, due_ms: due.as_millis() })
        }
        Ok(Settled::Termed) => Outcome::Termed(pb::Termed {}),
        Ok(Settled::Extended(deadline)) => Outcome::Extended(pb::Extended { deadline_ms: deadline.as_millis() }),
        Err(refused) => Outcome::Refused(refusal(&refused)),
    };
    pb::SettleReply { outcome: Some(outcome) }
}

fn refusal(refused: &GatewayError) -> pb::Refused {
    let message = refused.to_string();
    let named = |kind: &str, name: &str, name_is_group: bool| pb::Refused {
        kind: kind.to_owned(),
        message: message.clone(),
        name: name.to_owned(),
        name_is_group,
        named: String::new(),
    };
    match refused {
        GatewayError::MayNotConsume(group) => named("may_not_consume", group, true),
        GatewayError::MayNotSettle { refusal, .. } => match refusal.as_ref() {
            GatewayError::MayNotConsume(group) => named("may_not_settle", group, true),
            GatewayError::MayNotRead(topic) => named("may_not_settle", topic, false),
            _ => named("unavailable", "", false),
        },
        GatewayError::HandleOfAnotherGroup { owner, named: asked } => {
            pb::Refused { named: asked.clone(), ..named("handle_of_another_group", owner, true) }
        }
        GatewayError::Delivery(DeliveryError::Store(_)) => named("unavailable", "", false),
        GatewayError::Delivery(refusal) => named(refusal.code(), "", false),
        _ => named("unavailable", "", false),
    }
}

/// What the owner's reply means here, for delivery `id`.
pub(super) fn outcome_of(reply: pb::SettleReply, id: &str) -> Result<Settled, GatewayError> {
    match reply.outcome {
        Some(Outcome::Acked(_)) => Ok(Settled::Acked),
        Some(Outcome::Nacked(nacked)) if nacked.dead_lettered => Ok(Settled::Nacked(NackOutcome::DeadLetter)),
        Some(Outcome::Nacked(nacked)) => Ok(Settled::Nacked(NackOutcome::Retry {
            attempt: nacked.next_attempt,
            due: Epoch::from_millis(nacked.due_ms),
        })),
        Some(Outcome::Termed(_)) => Ok(Settled::Termed),
        Some(Outcome::Extended(extended)) => Ok(Settled::Extended(Epoch::from_millis(extended.deadline_ms))),
        Some(Outcome::Refused(refused)) => Err(refused_here(refused, id)),
        None => Err(GatewayError::Unavailable("the instance that handed the delivery out answered nothing".into())),
    }
}

fn refused_here(refused: pb::Refused, id: &str) -> GatewayError {
    let pb::Refused { kind, message, name, name_is_group, named } = refused;
    let delivery = |error: DeliveryError| GatewayError::Delivery(error);
    match kind.as_str() {
        "may_not_consume" => GatewayError::MayNotConsume(name),
        "may_not_settle" => GatewayError::MayNotSettle {
            delivery: id.to_owned(),
            refusal: Box::new(if name_is_group {
                GatewayError::MayNotConsume(name)
            } else {
                GatewayError::MayNotRead(name)
            }),
        },
        "handle_of_another_group" => GatewayError::HandleOfAnotherGroup { owner: name, named },
        "unknown" => delivery(DeliveryError::Unknown),
        "stale" => delivery(DeliveryError::Stale),
        "not_in_flight" => delivery(DeliveryError::NotInFlight),
        "superseded" => delivery(DeliveryError::Superseded),
        "busy" => delivery(DeliveryError::Busy),
        _ => GatewayError::Unavailable(message),
    }
}

/// The request that asks the other instances to end `request`'s transaction as `caller` asked; `None` for an
/// undecided end (nothing to ask: nothing changes).
pub(super) fn end_request(caller: &Caller, request: EndRequest<'_>) -> Option<pb::EndRequest> {
    let resolution = request.resolution?;
    let within = request.answer_by.map(|by| millis(by.saturating_duration_since(std::time::Instant::now())));
    Some(pb::EndRequest {
        caller: caller.name.clone(),
        source_ip: caller.source_ip().map(|ip| ip.to_string()).unwrap_or_default(),
        transaction_id: request.id.to_owned(),
        topic: request.topic.map(str::to_owned),
        commit: resolution == Resolution::Commit,
        from_check: request.from_check,
        answer_within_ms: within,
    })
}

/// The longest a peer's end request may ask the owner to wait for the broker (`answer_within_ms`): far past any
/// producer's deadline and the asking instance's own `tier.forward_timeout_ms`, and far from where an `Instant`
/// overflows (`u64::MAX` ms would panic).
const MAX_ANSWER_WITHIN: Duration = Duration::from_secs(3600);

/// What an end request asks, as the owner's gateway takes it.
pub(super) fn asked_end(request: &pb::EndRequest) -> EndRequest<'_> {
    let within = |ms: u64| Duration::from_millis(ms).min(MAX_ANSWER_WITHIN);
    EndRequest {
        id: &request.transaction_id,
        topic: request.topic.as_deref(),
        resolution: Some(if request.commit { Resolution::Commit } else { Resolution::Rollback }),
        from_check: request.from_check,
        answer_by: request.answer_within_ms.map(|ms| std::time::Instant::now() + within(ms)),
    }
}

/// The owner's reply to an end: not its transaction, ended, or refused.
pub(super) fn end_reply(outcome: Result<Option<EndOutcome>, GatewayError>) -> pb::EndReply {
    use pb::end_reply::Outcome;
    let refused = |kind: &str, message: String, name: &str| {
        Outcome::Refused(pb::EndRefused { kind: kind.to_owned(), message, name: name.to_owned() })
    };
    let outcome = match outcome {
        Ok(Some(EndOutcome { ended, topic })) => Outcome::Ended(pb::Ended { landed: ended == Ended::Landed, topic }),
        // An undecided end is never asked of another instance.
        Ok(None) => Outcome::NotHere(pb::NotHere {}),
        Err(GatewayError::Transaction(TransactionError::Unknown(_))) => Outcome::NotHere(pb::NotHere {}),
        Err(error) => {
            let message = error.to_string();
            match &error {
                GatewayError::MayNotPublish(topic) => refused("may_not_publish", message, topic),
                GatewayError::Transaction(TransactionError::AlreadyEnded { ended, .. }) => {
                    refused("already_ended", message, ended.as_str())
                }
                GatewayError::Transaction(TransactionError::Busy(_)) => refused("busy", message, ""),
                GatewayError::Transaction(TransactionError::Refused { .. }) => refused("refused", message, ""),
                _ => refused("unavailable", message, ""),
            }
        }
    };
    pb::EndReply { outcome: Some(outcome) }
}

/// What the owner's reply to an end means here: `None` when it is not that instance's transaction.
pub(super) fn end_outcome_of(reply: pb::EndReply, id: &str) -> Option<Result<EndOutcome, GatewayError>> {
    use pb::end_reply::Outcome;
    let transaction = |error: TransactionError| GatewayError::Transaction(error);
    Some(match reply.outcome? {
        Outcome::NotHere(_) => return None,
        Outcome::Ended(ended) => {
            Ok(EndOutcome { ended: if ended.landed { Ended::Landed } else { Ended::Owed }, topic: ended.topic })
        }
        Outcome::Refused(refused) => Err(match refused.kind.as_str() {
            "may_not_publish" => GatewayError::MayNotPublish(refused.name),
            "already_ended" => transaction(TransactionError::AlreadyEnded {
                id: id.to_owned(),
                ended: if refused.name == Resolution::Commit.as_str() {
                    Resolution::Commit
                } else {
                    Resolution::Rollback
                },
            }),
            "busy" => transaction(TransactionError::Busy(id.to_owned())),
            _ => GatewayError::Unavailable(refused.message),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every refusal the owner can answer comes out here as the same refusal, so the front maps it as its own.
    #[test]
    fn a_refusal_crosses_the_peer_link_unchanged() {
        let id = "popgate-1~ab";
        let refusals = || {
            [
                GatewayError::MayNotConsume("g".into()),
                GatewayError::MayNotSettle {
                    delivery: id.into(),
                    refusal: Box::new(GatewayError::MayNotRead("t".into())),
                },
                GatewayError::MayNotSettle {
                    delivery: id.into(),
                    refusal: Box::new(GatewayError::MayNotConsume("g".into())),
                },
                GatewayError::HandleOfAnotherGroup { owner: "g".into(), named: "h".into() },
                GatewayError::Delivery(DeliveryError::Unknown),
                GatewayError::Delivery(DeliveryError::Stale),
                GatewayError::Delivery(DeliveryError::NotInFlight),
                GatewayError::Delivery(DeliveryError::Superseded),
                GatewayError::Delivery(DeliveryError::Busy),
            ]
        };
        for (refused, sent) in refusals().into_iter().zip(refusals()) {
            let crossed = outcome_of(reply(Err(sent)), id).expect_err("refused");
            assert_eq!(crossed.to_string(), refused.to_string());
            assert_eq!(crossed.code(), refused.code());
        }
        let settled = [
            Settled::Acked,
            Settled::Termed,
            Settled::Extended(Epoch::from_millis(17)),
            Settled::Nacked(NackOutcome::DeadLetter),
            Settled::Nacked(NackOutcome::Retry { attempt: 3, due: Epoch::from_millis(99) }),
        ];
        for done in settled {
            assert_eq!(outcome_of(reply(Ok(done.clone())), id).expect("settled"), done);
        }
    }

    #[test]
    fn an_end_crosses_the_peer_link_as_the_owner_answered_it() {
        let id = "C0A8";
        let landed = EndOutcome { ended: Ended::Landed, topic: "t".into() };
        assert_eq!(end_outcome_of(end_reply(Ok(Some(landed.clone()))), id).expect("its").expect("ended"), landed);
        let owed = EndOutcome { ended: Ended::Owed, topic: "t".into() };
        assert_eq!(end_outcome_of(end_reply(Ok(Some(owed.clone()))), id).expect("its").expect("owed"), owed);
        let unknown = GatewayError::Transaction(TransactionError::Unknown(id.into()));
        assert!(end_outcome_of(end_reply(Err(unknown)), id).is_none(), "not that instance's");
        let refusals = || {
            [
                GatewayError::MayNotPublish("t".into()),
                GatewayError::Transaction(TransactionError::AlreadyEnded {
                    id: id.into(),
                    ended: Resolution::Rollback,
                }),
                GatewayError::Transaction(TransactionError::AlreadyEnded { id: id.into(), ended: Resolution::Commit }),
                GatewayError::Transaction(TransactionError::Busy(id.into())),
            ]
        };
        for (refused, sent) in refusals().into_iter().zip(refusals()) {
            let crossed = end_outcome_of(end_reply(Err(sent)), id).expect("its").expect_err("refused");
            assert_eq!((crossed.to_string(), crossed.code()), (refused.to_string(), refused.code()));
        }
        let caller = Caller::of_test_token("app", "*", "*");
        let asked = EndRequest {
            id,
            topic: Some("t"),
            resolution: Some(Resolution::Rollback),
            from_check: true,
            answer_by: None,
        };
        let request = end_request(&caller, asked).expect("decided");
        let back = asked_end(&request);
        assert_eq!(
            (back.id, back.topic, back.resolution, back.from_check),
            (id, Some("t"), Some(Resolution::Rollback), true)
        );
        let undecided = EndRequest { resolution: None, ..asked };
        assert!(end_request(&caller, undecided).is_none(), "nothing to ask");
    }

    #[test]
    fn an_end_asked_to_answer_within_any_time_has_a_deadline_at_most_an_hour_away() {
        let request = |within: Option<u64>| pb::EndRequest {
            caller: "app".into(),
            source_ip: String::new(),
            transaction_id: "C0A8".into(),
            topic: None,
            commit: true,
            from_check: false,
            answer_within_ms: within,
        };
        let before = std::time::Instant::now();
        for within in [u64::MAX, u64::MAX / 1000, 3_600_001] {
            let answer_by = asked_end(&request(Some(within))).answer_by.expect("a deadline");
            assert!(answer_by <= std::time::Instant::now() + MAX_ANSWER_WITHIN, "{within}");
        }
        let answer_by = asked_end(&request(Some(1_500))).answer_by.expect("a deadline");
        assert!(answer_by >= before + Duration::from_millis(1_500) && answer_by <= before + Duration::from_secs(60));
        assert_eq!(asked_end(&request(None)).answer_by, None);
    }

    #[test]
    fn a_request_carries_the_settlement_and_action_as_asked() {
        let caller = Caller::of_test_token("app", "*", "*").with_address("10.1.2.3".parse().expect("ip"));
        let settlement =
            Settlement { target: Target { id: "popgate-1~ab", handout: Some(4) }, group: Some("g"), lease: None };
        for action in [
            Settle::Ack,
            Settle::Nack { delay: Some(Duration::from_millis(1500)) },
            Settle::Nack { delay: None },
            Settle::Term { reason: "poison".into() },
            Settle::Extend { by: Duration::from_secs(30) },
        ] {
            let request = settle_request(&caller, settlement, &action);
            assert_eq!((request.caller.as_str(), request.source_ip.as_str()), ("app", "10.1.2.3"));
            let (asked_settlement, asked_action) = asked(&request).expect("an action");
            assert_eq!(asked_action, action);
            assert_eq!(asked_settlement.target, settlement.target);
            assert_eq!(asked_settlement.group, Some("g"));
        }
    }
}

#[cfg(test)]
mod decoding {
    use prost::Message as _;

    use super::*;

    proptest::proptest! {
        /// Whatever bytes reach the peer link as a settlement or an end, what decodes is read as a request or
        /// refused, never a panic (the signature is checked first; this is what a peer with the secret could send).
        #[test]
        fn arbitrary_peer_requests_are_read_or_refused_never_a_panic(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256),
        ) {
            if let Ok(request) = pb::SettleRequest::decode(&bytes[..]) {
                let _ = asked(&request);
            }
            if let Ok(request) = pb::EndRequest::decode(&bytes[..]) {
                let _ = asked_end(&request);
            }
            if let Ok(reply) = pb::SettleReply::decode(&bytes[..]) {
                let _ = outcome_of(reply, "popgate-1~ab");
            }
            if let Ok(reply) = pb::EndReply::decode(&bytes[..]) {
                let _ = end_outcome_of(reply, "popgate-1~ab");
            }
        }
    }
}
