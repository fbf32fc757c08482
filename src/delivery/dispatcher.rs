//! The [`Dispatcher`]: the delivery core's facade, the one entry point every transport shares (through the
//! gateway): it starts the core (recovery, the sweeper, a POP loop per subscription, the gauges) and turns each
//! subscribe, read, settlement and admin request into the state machine's steps (`state::Deliveries`).

use super::*;

/// The consume path's entry point, shared by every transport.
pub struct Dispatcher {
    pub(super) deliveries: Arc<Deliveries>,
    pub(super) tasks: parking_lot::Mutex<Vec<JoinHandle<()>>>,
    /// The push transports that run beside subscriptions (the HTTP front's webhook pusher), told of each change.
    pub(super) watcher: std::sync::OnceLock<Arc<dyn SubscriptionWatcher>>,
    /// Which consumer groups the cluster makes orderly.
    pub(super) group_order: Arc<group_order::GroupOrder>,
    /// In a tier, the ACKs made at the broker for other instances that could not be reached, until they ask.
    pub(super) untold: untold::Untold,
    /// The versions of the subscriptions a tier shares, and their removals (see [`shared`]).
    pub(super) shared: shared::Shared,
    /// In a tier, the current broker leases of other instances' deliveries, as their owners told them.
    pub(super) told_leases: told_leases::ToldLeases,
}

impl Dispatcher {
    /// Opens nothing itself: takes the store, replays it ([`recovery`]), starts the sweeper and a POP loop per
    /// subscription.
    ///
    /// # Errors
    /// [`DeliveryError::Store`] when the store cannot be read.
    ///
    /// `group_commit` is the WAL sync interval when the store does not sync each write (async-flush profiles).
    /// `instance` is this instance's id, the
    /// start of every delivery id it mints (empty: the ids name no instance).
    pub async fn start(
        store: Arc<StateStore>,
        broker: Arc<BrokerClient>,
        publisher: Arc<Publisher>,
        config: DeliveryConfig,
        group_commit: Option<Duration>,
        issuer: Issuer<'_>,
    ) -> Result<(Arc<Dispatcher>, RecoveryReport), DeliveryError> {
        let group_order = group_order::GroupOrder::new(broker.clone(), config.follow_group_config);
        let untold = untold::Untold::load(store.clone(), untold::MAX_UNTOLD).map_err(DeliveryError::Store)?;
        let shared = shared::Shared::load(store.clone(), issuer.instance).map_err(DeliveryError::Store)?;
        let deliveries = Arc::new(
            Deliveries::new(store, broker, publisher, config)
                .with_instance(issuer.instance, issuer.lease_seal)
                .giving_back_unclaimed(issuer.give_back_unclaimed),
        );
        let (report, poppers) = recovery::recover(&deliveries).await?;
        let dispatcher = Arc::new(Dispatcher {
            deliveries: deliveries.clone(),
            tasks: parking_lot::Mutex::new(Vec::new()),
            watcher: std::sync::OnceLock::new(),
            group_order,
            untold,
            shared,
            told_leases: told_leases::ToldLeases::new(),
        });
        dispatcher.spawn(sweeper::run(deliveries.clone()));
        dispatcher.spawn(gauges::run(deliveries.clone()));
        if let Some(interval) = group_commit {
            dispatcher.spawn(group_commit_loop(deliveries.clone(), interval));
        }
        for (key, stop) in poppers {
            dispatcher.spawn(popper::run(deliveries.clone(), key, stop));
        }
        Ok((dispatcher, report))
    }

    /// Starts a background task, kept for shutdown; finished ones (a stopped POP loop or webhook pusher) are
    /// dropped here, so the list holds what runs, not every task ever started.
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut tasks = self.tasks.lock();
        tasks.retain(|task| !task.is_finished());
        tasks.push(tokio::spawn(task));
    }

    /// Background tasks still kept (running, or finished since the last spawn).
    pub fn background_tasks(&self) -> usize {
        self.tasks.lock().len()
    }

    /// Runs recovery again (it is idempotent: tracked records are skipped). For operators and tests.
    ///
    /// # Errors
    /// [`DeliveryError::Store`] when the store cannot be read.
    pub async fn recover_again(&self) -> Result<RecoveryReport, DeliveryError> {
        let (report, poppers) = recovery::recover(&self.deliveries).await?;
        for (key, stop) in poppers {
            self.spawn(popper::run(self.deliveries.clone(), key, stop));
        }
        Ok(report)
    }

    /// Tells `watcher` of every subscription from now on, and at once of each one kept now (recovered at
    /// boot). Set once; a second watcher is refused (returned).
    ///
    /// # Errors
    /// The watcher, when one is set already.
    pub fn watch_subscriptions(
        &self,
        watcher: Arc<dyn SubscriptionWatcher>,
    ) -> Result<(), Arc<dyn SubscriptionWatcher>> {
        self.watcher.set(watcher)?;
        for sub in self.subscriptions() {
            self.tell_watcher(|watcher| watcher.subscribed(&sub));
        }
        Ok(())
    }

    fn tell_watcher(&self, tell: impl FnOnce(&dyn SubscriptionWatcher)) {
        if let Some(watcher) = self.watcher.get() {
            tell(watcher.as_ref());
        }
    }

    /// Creates or updates a subscription (persisted) and starts its POP loop.
    ///
    /// # Errors
    /// [`DeliveryError::Invalid`] naming a bad field; [`DeliveryError::Store`] when it cannot be stored.
    pub async fn subscribe(&self, request: SubscriptionRequest) -> Result<Subscription, DeliveryError> {
        let _changing = self.shared.changing.lock().await;
        self.subscribe_now(request).await
    }

    /// As [`Dispatcher::subscribe`], the caller holding the lock on shared changes. A subscription asked for
    /// gets its version (the request's, when another instance made the change; else a new one, and the change
    /// is told to the tier).
    pub(super) async fn subscribe_now(&self, request: SubscriptionRequest) -> Result<Subscription, DeliveryError> {
        let config = self.deliveries.config();
        validate_name("group", &request.group)?;
        validate_name("topic", &request.topic)?;
        let existing = self.deliveries.subscription(&request.group, &request.topic);
        let implicit = request.implicit && existing.as_ref().is_none_or(|existing| existing.implicit);
        let key = Subscription::key_of(&request.group, &request.topic);
        let told = request.shared_version.is_some();
        if !implicit && existing.as_ref().is_none_or(|existing| existing.implicit) && self.asked_subscriptions_full() {
            return Err(DeliveryError::Invalid(
                "group",
                format!(
                    "popgate keeps at most {} subscriptions asked for; remove one first",
                    shared::MAX_ASKED_SUBSCRIPTIONS
                ),
            ));
        }
        let version = (!implicit).then(|| {
            request.shared_version.clone().unwrap_or_else(|| {
                self.shared.next_version(&key, existing.as_ref().and_then(|existing| existing.version.as_ref()))
            })
        });
        let sub = Subscription {
            group: request.group,
            topic: request.topic,
            filter: request.filter.unwrap_or_else(|| "*".to_owned()),
            filter_type: request.filter_type.unwrap_or_default(),
            ack_timeout_ms: request.ack_timeout_ms.unwrap_or(config.ack_timeout_ms),
            max_attempts: request.max_attempts.unwrap_or(config.max_attempts),
            initial_backoff_ms: request.initial_backoff_ms.unwrap_or(config.initial_backoff_ms),
            max_backoff_ms: request.max_backoff_ms.unwrap_or(config.max_backoff_ms),
            ordered: request.ordered.unwrap_or(false),
            push: request.push,
            implicit,
            version,
        };
        if sub.filter.trim().is_empty() {
            let what = match sub.filter_type {
                FilterType::Tag => "must be a tag expression such as `*` or `a || b`",
                FilterType::Sql92 => "must be an SQL92 expression such as `a > 5 AND b = 'x'`",
            };
            return Err(DeliveryError::Invalid("filter", what.into()));
        }
        if let Some((setting, reason)) =
            bounds::check(sub.ack_timeout_ms, sub.max_attempts, sub.initial_backoff_ms, sub.max_backoff_ms)
                .into_iter()
                .next()
        {
            return Err(DeliveryError::Invalid(setting.api_field(), reason));
        }
        let policy = RetryPolicy::try_new(
            Duration::from_millis(sub.initial_backoff_ms),
            Duration::from_millis(sub.max_backoff_ms),
            config.jitter_ratio,
            sub.max_attempts,
        )
        .map_err(|e| DeliveryError::Invalid("initialBackoffMs", e.to_string()))?;
        if let Some(stop) = self.deliveries.put_subscription(sub.clone(), policy).await? {
            self.spawn(popper::run(self.deliveries.clone(), sub.key(), stop));
        }
        self.tell_watcher(|watcher| watcher.subscribed(&sub));
        if !implicit {
            // Newer than any removal remembered (a local change's version is; a told one was checked).
            self.shared.forget_removal(&key).await;
            if !told {
                self.shared.announce(SharedChange::Put(sub.clone()));
            }
        }
        Ok(sub)
    }

    /// Removes a subscription: its POP loop and webhook stop, and its unsettled events are given back to the
    /// broker (not ACKed), which redelivers them to whoever subscribes next.
    ///
    /// # Errors
    /// [`DeliveryError::Unknown`] when there is no such subscription; [`DeliveryError::Store`].
    pub async fn unsubscribe(&self, group: &str, topic: &str) -> Result<(), DeliveryError> {
        let _changing = self.shared.changing.lock().await;
        let existing = self.deliveries.subscription(group, topic);
        self.remove_now(group, topic).await?;
        // Remembered and told to the tier, so every instance removes it and none brings it back.
        let key = Subscription::key_of(group, topic);
        let version = self.shared.next_version(&key, existing.and_then(|existing| existing.version).as_ref());
        if let Err(error) = self.shared.remember_removal(&key, &version).await {
            tracing::warn!(%error, group, topic, "Could not store a subscription's removal; peers may bring it back.");
        }
        let (group, topic) = (group.to_owned(), topic.to_owned());
        self.shared.announce(SharedChange::Removed { group, topic, version });
        Ok(())
    }

    /// Whether as many subscriptions are asked for as popgate keeps ([`shared::MAX_ASKED_SUBSCRIPTIONS`]).
    fn asked_subscriptions_full(&self) -> bool {
        self.subscriptions().iter().filter(|sub| !sub.implicit).count() >= shared::MAX_ASKED_SUBSCRIPTIONS
    }

    /// Removes a subscription here (the caller holds the lock on shared changes): as
    /// [`Dispatcher::unsubscribe`], told to nobody.
    pub(super) async fn remove_now(&self, group: &str, topic: &str) -> Result<(), DeliveryError> {
        self.deliveries.remove_subscription(group, topic).await?;
        self.tell_watcher(|watcher| watcher.unsubscribed(&Subscription::key_of(group, topic)));
        Ok(())
    }

    /// The subscription of `group`/`topic`, created with the defaults when there is none.
    ///
    /// # Errors
    /// As [`Dispatcher::subscribe`].
    pub async fn ensure_subscription(&self, group: &str, topic: &str) -> Result<Subscription, DeliveryError> {
        let sub = match self.deliveries.subscription(group, topic) {
            Some(sub) => sub,
            None => {
                return self
                    .subscribe(SubscriptionRequest {
                        group: group.to_owned(),
                        topic: topic.to_owned(),
                        ordered: Some(self.group_order.orderly(group).await),
                        implicit: true,
                        ..Default::default()
                    })
                    .await
            }
        };
        self.follow_group_order(sub).await
    }

    /// Whether the cluster's config makes consumer group `group` orderly (`consumeMessageOrderly`): FIFO, as
    /// Apache's proxy decides it. A new group waits for the brokers at most 2 s.
    pub async fn group_orderly(&self, group: &str) -> bool {
        self.group_order.orderly(group).await
    }

    /// Whether `sub` is to be ordered, as [`Dispatcher::follow_group_order`] says.
    async fn ordered_as_its_group(&self, sub: &Subscription) -> bool {
        let orderly = self.group_order.orderly(&sub.group).await;
        if sub.implicit {
            orderly
        } else {
            sub.ordered || orderly
        }
    }

    /// `sub` ordered as its group's config says: a subscription a receive created follows the config both
    /// ways; one made with `POST /events/subscribe` becomes ordered when the group is, and keeps its own
    /// `ordered` otherwise.
    async fn follow_group_order(&self, sub: Subscription) -> Result<Subscription, DeliveryError> {
        let ordered = self.ordered_as_its_group(&sub).await;
        if ordered == sub.ordered {
            return Ok(sub);
        }
        tracing::info!(group = %sub.group, topic = %sub.topic, ordered, "Following the group's config at the broker.");
        let mut request = SubscriptionRequest::from(sub);
        request.ordered = Some(ordered);
        self.subscribe(request).await
    }

    /// The subscription of `group`/`topic`, if there is one.
    pub fn subscription(&self, group: &str, topic: &str) -> Option<Subscription> {
        self.deliveries.subscription(group, topic)
    }

    /// The consumer group and topic of an in-flight delivery (to authorize its ACK, NACK or TERM).
    pub fn source_of(&self, id: &str) -> Option<(String, String)> {
        self.deliveries.source_of(id)
    }

    /// Up to `max` in-flight deliveries (of `group`, when given), oldest admission first: the admin view.
    pub fn in_flight(&self, group: Option<&str>, max: usize) -> Vec<InFlight> {
        self.deliveries.in_flight(group, max)
    }

    /// Every subscription.
    pub fn subscriptions(&self) -> Vec<Subscription> {
        self.deliveries.subscriptions()
    }

    /// The subscription of `group`/`topic` with the tag expression `filter`: created with the defaults when
    /// there is none, its filter changed when it differs (a gRPC consumer names its filter on every receive).
    ///
    /// # Errors
    /// As [`Dispatcher::subscribe`].
    pub async fn ensure_filtered(
        &self,
        group: &str,
        topic: &str,
        filter: &str,
        filter_type: FilterType,
    ) -> Result<Subscription, DeliveryError> {
        let Some(sub) = self.deliveries.subscription(group, topic) else {
            return self
                .subscribe(SubscriptionRequest {
                    group: group.to_owned(),
                    topic: topic.to_owned(),
                    filter: Some(filter.to_owned()),
                    filter_type: Some(filter_type),
                    ordered: Some(self.group_order.orderly(group).await),
                    implicit: true,
                    ..Default::default()
                })
                .await;
        };
        if sub.filter == filter && sub.filter_type == filter_type {
            return self.follow_group_order(sub).await;
        }
        // Consumers of one group asking for different filters would otherwise rewrite the stored
        // subscription on every receive. As at a RocketMQ broker, the group has one subscription, and the
        // filter in force is the latest change; changes are taken at most once per interval.
        if !self.deliveries.may_change_filter(&sub.key()) {
            metrics::counter!(crate::metrics::SUBSCRIPTION_FILTER_CONFLICTS).increment(1);
            tracing::debug!(group, topic, filter, current = %sub.filter, "Filter change refused: changed too recently.");
            return Ok(sub);
        }
        // One write for the new filter and the group's ordering together.
        let ordered = self.ordered_as_its_group(&sub).await;
        let mut request = SubscriptionRequest::from(sub);
        request.filter = Some(filter.to_owned());
        request.filter_type = Some(filter_type);
        request.ordered = Some(ordered);
        self.subscribe(request).await
    }

    /// Long-polls up to `max` deliveries for `group`/`topic`, waiting at most `wait` when none is ready.
    ///
    /// # Errors
    /// [`DeliveryError::Store`] when the hand-out cannot be recorded (nothing is handed out then).
    pub async fn poll(
        &self,
        group: &str,
        topic: &str,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Dispatched>, DeliveryError> {
        let key = self.ensure_subscription(group, topic).await?.key();
        self.poll_key(&key, max, wait, &HandOut::long_poll()).await
    }

    /// As [`Dispatcher::poll`], on an existing subscription, handed out as `to` says (the gRPC front).
    ///
    /// # Errors
    /// As [`Dispatcher::poll`]; [`DeliveryError::Unknown`] when there is no such subscription.
    pub async fn poll_as(
        &self,
        sub: &Subscription,
        max: usize,
        wait: Duration,
        to: &HandOut,
    ) -> Result<Vec<Dispatched>, DeliveryError> {
        self.poll_key(&sub.key(), max, wait, to).await
    }

    async fn poll_key(
        &self,
        key: &str,
        max: usize,
        wait: Duration,
        to: &HandOut,
    ) -> Result<Vec<Dispatched>, DeliveryError> {
        let key = key.to_owned();
        let max = max.clamp(1, MAX_POLL_BATCH);
        let _demand = Demand::register(&self.deliveries, &key, max);
        let deadline = tokio::time::Instant::now() + wait.min(MAX_POLL_WAIT);
        let bells = self.deliveries.bells(&key);
        loop {
            let notified = bells.polls.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let taken = self.deliveries.hand_out(&key, max, to, None).await?;
            if taken.is_empty() {
                if let Some(refusal) = self.deliveries.filter_refusal(&key) {
                    return Err(DeliveryError::Invalid("filter", format!("the broker refused the filter: {refusal}")));
                }
            }
            if !taken.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(taken);
            }
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// Attaches a push subscriber (SSE, WebSocket) to `group`/`topic`, creating the subscription with the
    /// defaults if there is none. `prefetch` (default `delivery.prefetch`) bounds its unACKed deliveries.
    ///
    /// # Errors
    /// As [`Dispatcher::subscribe`]; [`DeliveryError::Invalid`] for a prefetch out of bounds.
    pub async fn attach(
        &self,
        group: &str,
        topic: &str,
        prefetch: Option<usize>,
        transport: &'static str,
    ) -> Result<Subscriber, DeliveryError> {
        let prefetch = prefetch.unwrap_or(self.deliveries.config().prefetch);
        if !bounds::PREFETCH.contains(&prefetch) {
            let (low, high) = (bounds::PREFETCH.start(), bounds::PREFETCH.end());
            return Err(DeliveryError::Invalid("prefetch", format!("must be in {low}..={high}")));
        }
        let key = self.ensure_subscription(group, topic).await?.key();
        Ok(Subscriber::new(self.deliveries.clone(), key, prefetch, transport))
    }

    /// The subscriber's ACK: the ACK intent is stored, then the broker ACK follows. Accepted only for a
    /// delivery that is handed out (awaiting its ACK).
    ///
    /// # Errors
    /// [`DeliveryError::Unknown`] (404), [`DeliveryError::Stale`] and [`DeliveryError::NotInFlight`] (409),
    /// [`DeliveryError::Busy`] and [`DeliveryError::Store`] (503).
    pub async fn ack<'a>(&self, target: impl Into<Target<'a>>) -> Result<(), DeliveryError> {
        self.deliveries.ack(target.into()).await
    }

    /// ACKs a batch, each id answered as [`Dispatcher::ack`] would, in the order of `ids`: the ACK intents in
    /// one store write, then one batch ACK request per broker.
    pub async fn ack_many(&self, ids: &[impl AsRef<str>]) -> Vec<Result<(), DeliveryError>> {
        let targets: Vec<Target<'_>> = ids.iter().map(|id| Target::from(id.as_ref())).collect();
        self.deliveries.ack_many(&targets).await
    }

    /// [`Dispatcher::ack_many`] for targets that may name their hand-out.
    pub async fn ack_targets(&self, targets: &[Target<'_>]) -> Vec<Result<(), DeliveryError>> {
        self.deliveries.ack_many(targets).await
    }

    /// The broker lease a handle's sealed `token` carries, when this tier sealed it for delivery `id`
    /// ([`LeaseSeal`]).
    pub fn open_lease(&self, id: &str, token: &str) -> Option<Lease> {
        self.deliveries.open_lease(id, token)
    }

    /// ACKs at the broker a delivery another instance handed out, with the lease its handle carries: for when
    /// that instance cannot be reached. Nothing is recorded here; the caller tells the owner.
    ///
    /// # Errors
    /// [`DeliveryError::Stale`] for a lease that ran out; [`DeliveryError::Busy`] when the broker did not take
    /// the ACK.
    pub async fn ack_lease(&self, lease: &Lease) -> Result<(), DeliveryError> {
        self.deliveries.ack_lease(lease).await
    }

    /// Keeps a note, in the store, that `target`, handed out by instance `owner`, was ACKed at the broker
    /// without it ([`Dispatcher::ack_lease`]), until `owner` asks ([`Dispatcher::take_untold`]).
    pub async fn note_untold(&self, owner: &str, target: Target<'_>) {
        self.untold.remember(owner, target).await;
    }

    /// The deliveries of instance `owner` ACKed at the broker without it (delivery id, hand-out), not told to it
    /// yet; from now on they are told.
    pub async fn take_untold(&self, owner: &str) -> Vec<(String, Option<u32>)> {
        self.untold.take(owner).await
    }

    /// NACK: the attempt is spent; the next is scheduled after `delay` (or the backoff), or the DLQ.
    ///
    /// # Errors
    /// [`DeliveryError::Invalid`] naming `delayMs` for a delay past [`bounds::MAX_NACK_DELAY_MS`], refused
    /// before the delivery is touched; otherwise as [`Dispatcher::ack`].
    pub async fn nack<'a>(
        &self,
        target: impl Into<Target<'a>>,
        delay: Option<Duration>,
    ) -> Result<NackOutcome, DeliveryError> {
        check_nack_delay(delay)?;
        self.deliveries.nack(target.into(), delay).await
    }

    /// TERM: straight to the DLQ with `reason`.
    ///
    /// # Errors
    /// As [`Dispatcher::ack`].
    pub async fn term<'a>(&self, target: impl Into<Target<'a>>, reason: &str) -> Result<(), DeliveryError> {
        self.deliveries.term(target.into(), reason).await
    }

    /// Extends the ACK deadline of a handed-out delivery to `by` from now (a SimpleConsumer's
    /// ChangeInvisibleDuration); returns the new deadline.
    ///
    /// # Errors
    /// As [`Dispatcher::ack`].
    pub async fn extend<'a>(&self, target: impl Into<Target<'a>>, by: Duration) -> Result<Epoch, DeliveryError> {
        self.deliveries.extend(target.into(), by).await
    }

    /// The group, topic and gRPC holder of an in-flight delivery (to check a gRPC settlement).
    pub fn hold_of(&self, id: &str) -> Option<(String, String, Option<Holder>)> {
        self.deliveries.hold_of(id)
    }

    /// `clients` are alive: the deliveries they hold with `auto_renew` stay handed out for `hold` more, up to
    /// `max_hold` after their hand-out. Returns how many were extended.
    ///
    /// # Errors
    /// [`DeliveryError::Store`] when the new deadlines cannot be stored (nothing changes then).
    pub async fn keep_held(
        &self,
        clients: &std::collections::HashSet<String>,
        hold: Duration,
        max_hold: Duration,
    ) -> Result<usize, DeliveryError> {
        self.deliveries.keep_held(clients, hold, max_hold).await
    }

    /// These hand-outs (delivery id, hand-out number) reached their gRPC client: the whole response that
    /// carried them was taken in. Until then an auto-renewed delivery is not renewed, and a restart dispatches
    /// it again at once (see [`Holder::written`]). Returns how many were marked.
    ///
    /// # Errors
    /// [`DeliveryError::Store`] when the mark cannot be stored (the deliveries stay as they were).
    pub async fn written(&self, handed: &[(String, u32)]) -> Result<usize, DeliveryError> {
        self.deliveries.mark_written(handed).await
    }

    /// `client_id` left consumer group `group` (a gRPC NotifyClientTermination, a remoting UNREGISTER_CLIENT):
    /// what it held of that group and did not settle is NACKed, so its next attempt is due at once instead of
    /// after its ACK deadline. What it holds of other groups stays held: one client instance may consume as
    /// several groups and leave only one. Returns how many.
    pub async fn release_client(&self, client_id: &str, group: &str) -> usize {
        let held = self.deliveries.held_by_client(client_id);
        let mut released = 0;
        for id in held {
            if self.deliveries.hold_of(&id).is_none_or(|(held_group, _, _)| held_group != group) {
                continue;
            }
            if self.deliveries.nack(Target::from(&id), Some(Duration::ZERO)).await.is_ok() {
                released += 1;
            }
        }
        released
    }

    /// These deliveries were handed out but could not be sent to their client (it went away first): they
    /// are dispatched again at once, their attempt not spent.
    pub async fn unsent(&self, ids: &[String], transport: &'static str) {
        self.deliveries.push_failed(ids, transport, "push_failure").await;
    }

    /// False after a failed state-store write, until a write succeeds again.
    pub fn store_healthy(&self) -> bool {
        self.deliveries.store().is_healthy()
    }

    /// Stops every background task (POP loops, sweeper). In-flight state stays in the store.
    pub async fn shutdown(&self) {
        self.deliveries.shut_down();
        self.tell_watcher(|watcher| watcher.shut_down());
        let tasks: Vec<JoinHandle<()>> = self.tasks.lock().drain(..).collect();
        for task in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    }
}

/// Syncs the WAL every `interval` until shutdown: bounded loss for async-flush profiles, whose writes are not
/// synced one by one. One last sync runs on the way out.
async fn group_commit_loop(deliveries: Arc<Deliveries>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    while !deliveries.is_shutting_down() {
        tick.tick().await;
        deliveries.sync_wal().await;
    }
    deliveries.sync_wal().await;
}

/// A waiting subscriber's demand on its subscription, withdrawn when the wait ends (or its client goes away).
pub(super) struct Demand {
    deliveries: Arc<Deliveries>,
    key: String,
    count: usize,
}

impl Demand {
    pub(super) fn register(deliveries: &Arc<Deliveries>, key: &str, count: usize) -> Demand {
        deliveries.add_demand(key, count);
        Demand { deliveries: deliveries.clone(), key: key.to_owned(), count }
    }
}

impl Drop for Demand {
    fn drop(&mut self) {
        self.deliveries.withdraw_demand(&self.key, self.count);
    }
}

/// A NACK delay is at most the longest ACK timeout. Checked here, the one entry every transport's NACK takes
/// (HTTP, WebSocket, webhook), so each answers it as the bad `delayMs` it is.
fn check_nack_delay(delay: Option<Duration>) -> Result<(), DeliveryError> {
    match delay {
        Some(delay) if delay > Duration::from_millis(bounds::MAX_NACK_DELAY_MS) => Err(DeliveryError::Invalid(
            "delayMs",
            format!("must be at most {} ms (the longest ACK timeout)", bounds::MAX_NACK_DELAY_MS),
        )),
        _ => Ok(()),
    }
}

/// Group and topic names: RocketMQ's character set, at most 127 characters.
fn validate_name(field: &'static str, name: &str) -> Result<(), DeliveryError> {
    if crate::broker::message::is_valid_name(name) {
        Ok(())
    } else {
        Err(DeliveryError::Invalid(field, format!("`{name}` must be 1..=127 letters, digits, `_`, `-`, `%`, `|`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nack_delay_is_bounded_by_the_longest_ack_timeout_and_refusals_name_delay_ms() {
        for accepted in [None, Some(0), Some(1_000), Some(3_600_000)] {
            assert!(check_nack_delay(accepted.map(Duration::from_millis)).is_ok(), "{accepted:?}");
        }
        for refused in [3_600_001, 1_000_000_000_000_000, i64::MAX as u64, u64::MAX] {
            match check_nack_delay(Some(Duration::from_millis(refused))) {
                Err(DeliveryError::Invalid(field, reason)) => {
                    assert_eq!(field, "delayMs");
                    assert!(reason.contains("3600000"), "{reason}");
                }
                other => panic!("{refused} ms: {other:?}"),
            }
        }
    }
}
