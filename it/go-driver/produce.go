package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/apache/rocketmq-client-go/v2"
	"github.com/apache/rocketmq-client-go/v2/primitive"
	"github.com/apache/rocketmq-client-go/v2/producer"
)

// produce sends `count` messages in `mode` (sync, async, oneway, batch) and reports each send.
//
// Result: `sent` [{index, body, msgId, offsetMsgId, status, broker, queueId, queueOffset}] (oneway: index and
// body only), `errors` [{index, body, error}], `timedOut` (async: callbacks missing at the deadline).
func produce(a *Args, start time.Time) (result, error) {
	p, err := rocketmq.NewProducer(producerOptions(a)...)
	if err != nil {
		return nil, fmt.Errorf("new producer: %w", err)
	}
	if err := p.Start(); err != nil {
		return nil, fmt.Errorf("start producer: %w", err)
	}
	defer p.Shutdown()

	mode := a.Mode
	if mode == "" {
		mode = "sync"
	}
	count := a.Count
	if count == 0 {
		count = 1
	}
	ctx, cancel := context.WithDeadline(context.Background(), a.deadline(start))
	defer cancel()

	sent := []result{}
	errs := []result{}
	timedOut := false
	switch mode {
	case "sync":
		for i := a.StartIndex; i < a.StartIndex+count; i++ {
			msg, body := message(a, i)
			r, err := p.SendSync(ctx, msg)
			if err != nil {
				errs = append(errs, result{"index": i, "body": body, "error": err.Error()})
				continue
			}
			sent = append(sent, sendEntry(i, body, r))
		}
	case "async":
		// Every send is started at once; each callback records its outcome.
		var mu sync.Mutex
		var wg sync.WaitGroup
		for i := a.StartIndex; i < a.StartIndex+count; i++ {
			msg, body := message(a, i)
			wg.Add(1)
			err := p.SendAsync(ctx, func(_ context.Context, r *primitive.SendResult, err error) {
				defer wg.Done()
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, result{"index": i, "body": body, "error": err.Error()})
				} else {
					sent = append(sent, sendEntry(i, body, r))
				}
			}, msg)
			if err != nil {
				wg.Done()
				mu.Lock()
				errs = append(errs, result{"index": i, "body": body, "error": err.Error()})
				mu.Unlock()
			}
		}
		timedOut = !waitUntil(&wg, a.deadline(start))
		mu.Lock()
		sent = append([]result{}, sent...)
		errs = append([]result{}, errs...)
		mu.Unlock()
	case "oneway":
		for i := a.StartIndex; i < a.StartIndex+count; i++ {
			msg, body := message(a, i)
			if err := p.SendOneWay(ctx, msg); err != nil {
				errs = append(errs, result{"index": i, "body": body, "error": err.Error()})
				continue
			}
			sent = append(sent, result{"index": i, "body": body})
		}
	case "batch":
		// One request: the client encodes the messages as one batch (SEND_BATCH_MESSAGE).
		msgs := []*primitive.Message{}
		bodies := []string{}
		for i := a.StartIndex; i < a.StartIndex+count; i++ {
			msg, body := message(a, i)
			msgs = append(msgs, msg)
			bodies = append(bodies, body)
		}
		r, err := p.SendSync(ctx, msgs...)
		if err != nil {
			errs = append(errs, result{"index": a.StartIndex, "body": strings.Join(bodies, ","), "error": err.Error()})
			break
		}
		// The client reports the broker's offset ids of a batch joined by commas, in order, and no message ids
		// (it gives a batch's messages none: msgId is each message's own UNIQ_KEY, empty unless the app set one).
		offsetIDs := strings.Split(r.OffsetMsgID, ",")
		for n, body := range bodies {
			entry := sendEntry(a.StartIndex+n, body, r)
			entry["msgId"] = msgs[n].GetProperty(primitive.PropertyUniqueClientMessageIdKeyIndex)
			if len(offsetIDs) == len(bodies) {
				entry["offsetMsgId"] = offsetIDs[n]
			}
			entry["queueOffset"] = r.QueueOffset + int64(n)
			sent = append(sent, entry)
		}
	default:
		return nil, fmt.Errorf("bad arguments: mode %q", mode)
	}
	return result{"mode": mode, "sent": sent, "errors": errs, "timedOut": timedOut}, nil
}

// producerOptions are the options a producer (plain or transactional) is built with from a.
func producerOptions(a *Args) []producer.Option {
	group := a.Group
	if group == "" {
		group = "driver_producer"
	}
	retries := 2
	if a.RetryTimes != nil {
		retries = *a.RetryTimes
	}
	sendTimeout := 3000
	if a.SendTimeoutMs != 0 {
		sendTimeout = a.SendTimeoutMs
	}
	opts := []producer.Option{
		producer.WithNameServer([]string{a.Namesrv}),
		producer.WithGroupName(group),
		producer.WithRetry(retries),
		producer.WithSendMsgTimeout(time.Duration(sendTimeout) * time.Millisecond),
	}
	if a.InstanceName != "" {
		opts = append(opts, producer.WithInstanceName(a.InstanceName))
	}
	if a.AccessKey != "" {
		opts = append(opts, producer.WithCredentials(a.credentials()))
	}
	switch {
	case a.QueueID != nil:
		opts = append(opts, producer.WithQueueSelector(queueSelector{queueID: *a.QueueID, broker: a.BrokerName}))
	case a.OrderKey != "":
		opts = append(opts, producer.WithQueueSelector(producer.NewHashQueueSelector()))
	}
	return opts
}

// queueSelector is an app's own queue selector: always the queue with queueID (on broker, when named).
type queueSelector struct {
	queueID int
	broker  string
}

// Select picks the queue; none (the send fails) when the route has no such queue.
func (s queueSelector) Select(_ *primitive.Message, mqs []*primitive.MessageQueue, _ string) *primitive.MessageQueue {
	for _, mq := range mqs {
		if mq.QueueId == s.queueID && (s.broker == "" || mq.BrokerName == s.broker) {
			return mq
		}
	}
	return nil
}

// message is message i of the scenario, with its tag, keys, properties, delay level and sharding key, and the
// label its body is reported by.
func message(a *Args, i int) (*primitive.Message, string) {
	body, label := a.body(i)
	msg := primitive.NewMessage(a.Topic, body)
	if a.Tag != "" {
		msg.WithTag(subst(a.Tag, i))
	}
	if a.Keys != "" {
		msg.WithKeys(strings.Fields(subst(a.Keys, i)))
	}
	for k, v := range a.Properties {
		msg.WithProperty(k, subst(v, i))
	}
	if a.DelayLevel > 0 {
		msg.WithDelayTimeLevel(a.DelayLevel)
	}
	if a.OrderKey != "" {
		msg.WithShardingKey(subst(a.OrderKey, i))
	}
	return msg, label
}

// subst replaces "{i}" in template with the message's index.
func subst(template string, i int) string {
	return strings.ReplaceAll(template, "{i}", fmt.Sprint(i))
}

// sendEntry is what the client answered for a send.
func sendEntry(i int, body string, r *primitive.SendResult) result {
	entry := result{
		"index":       i,
		"body":        body,
		"msgId":       r.MsgID,
		"offsetMsgId": r.OffsetMsgID,
		"status":      sendStatus(r.Status),
		"queueOffset": r.QueueOffset,
	}
	if r.MessageQueue != nil {
		entry["broker"] = r.MessageQueue.BrokerName
		entry["queueId"] = r.MessageQueue.QueueId
	}
	return entry
}

// sendStatus is the send status by the Java client's name for it.
func sendStatus(s primitive.SendStatus) string {
	switch s {
	case primitive.SendOK:
		return "SEND_OK"
	case primitive.SendFlushDiskTimeout:
		return "FLUSH_DISK_TIMEOUT"
	case primitive.SendFlushSlaveTimeout:
		return "FLUSH_SLAVE_TIMEOUT"
	case primitive.SendSlaveNotAvailable:
		return "SLAVE_NOT_AVAILABLE"
	default:
		return "UNKNOWN_ERROR"
	}
}

// waitUntil waits for wg until deadline; whether it was done in time.
func waitUntil(wg *sync.WaitGroup, deadline time.Time) bool {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(time.Until(deadline)):
		return false
	}
}
