package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/apache/rocketmq-client-go/v2"
	"github.com/apache/rocketmq-client-go/v2/consumer"
	"github.com/apache/rocketmq-client-go/v2/primitive"
)

// pushConsume runs a push consumer (concurrent or orderly, CLUSTERING or BROADCASTING) until `expect` distinct
// bodies and `expectDeliveries` deliveries were received (then `settleMs` more) or the deadline, and reports every
// delivery.
//
// Result: `received` [every delivery in arrival order: body, bodyLength, msgId, offsetMsgId, topic, tags, keys,
// queueTopic (the topic of the queue pulled: %RETRY%<group> for a message that came back), broker, queueId,
// queueOffset, reconsumeTimes, properties, delivery (the how-manieth of its body), atMs,
// result], `timedOut`, `deliveries`, `distinctBodies`.
func pushConsume(a *Args, start time.Time) (result, error) {
	if a.Group == "" || a.Topic == "" {
		return nil, fmt.Errorf("bad arguments: group and topic are required")
	}
	opts := []consumer.Option{
		consumer.WithNameServer([]string{a.Namesrv}),
		consumer.WithGroupName(a.Group),
		consumer.WithConsumerOrder(a.Orderly),
	}
	if a.Broadcasting {
		opts = append(opts, consumer.WithConsumerModel(consumer.BroadCasting))
	}
	if a.ConsumeFromWhere == "first" {
		opts = append(opts, consumer.WithConsumeFromWhere(consumer.ConsumeFromFirstOffset))
	}
	if a.MaxReconsumeTimes != nil {
		opts = append(opts, consumer.WithMaxReconsumeTimes(*a.MaxReconsumeTimes))
	}
	if a.InstanceName != "" {
		opts = append(opts, consumer.WithInstance(a.InstanceName))
	}
	if a.AccessKey != "" {
		opts = append(opts, consumer.WithCredentials(a.credentials()))
	}
	c, err := rocketmq.NewPushConsumer(opts...)
	if err != nil {
		return nil, fmt.Errorf("new push consumer: %w", err)
	}

	seen := newDeliveries(a)
	expression := a.SubExpression
	if expression == "" {
		expression = "*"
	}
	listener := func(ctx context.Context, msgs ...*primitive.MessageExt) (consumer.ConsumeResult, error) {
		// The queue the messages came from, as the client's context names it.
		var mq primitive.MessageQueue
		if oc, ok := primitive.GetOrderlyCtx(ctx); ok {
			mq = oc.MQ
		} else if cc, ok := primitive.GetConcurrentlyCtx(ctx); ok {
			mq = cc.MQ
		}
		if !seen.record(msgs, mq) {
			return consumer.ConsumeSuccess, nil
		}
		if a.Orderly {
			return consumer.SuspendCurrentQueueAMoment, nil
		}
		if cc, ok := primitive.GetConcurrentlyCtx(ctx); ok && a.RetryDelayLevel > 0 {
			cc.DelayLevelWhenNextConsume = a.RetryDelayLevel
		}
		return consumer.ConsumeRetryLater, nil
	}
	// The client wants its subscription before it starts.
	if err := c.Subscribe(a.Topic, consumer.MessageSelector{Type: consumer.TAG, Expression: expression}, listener); err != nil {
		return nil, fmt.Errorf("subscribe: %w", err)
	}
	if err := c.Start(); err != nil {
		return nil, fmt.Errorf("start push consumer: %w", err)
	}
	startedMs := millis(time.Now())

	reached := seen.await(a.Expect, a.ExpectDeliveries, a.deadline(start))
	if reached && a.SettleMs > 0 {
		time.Sleep(time.Duration(a.SettleMs) * time.Millisecond)
	}
	_ = c.Shutdown()

	out := seen.report()
	out["startedMs"] = startedMs
	out["timedOut"] = (a.Expect > 0 || a.ExpectDeliveries > 0) && !reached
	return out, nil
}

// deliveries are every delivery a consumer saw, in arrival order.
type deliveries struct {
	mu         sync.Mutex
	changed    *sync.Cond
	failTimes  int
	failBodies map[string]bool // nil: every body
	orderly    bool
	received   []result
	perBody    map[string]int
}

func newDeliveries(a *Args) *deliveries {
	d := &deliveries{failTimes: a.FailTimes, orderly: a.Orderly, perBody: map[string]int{}}
	d.changed = sync.NewCond(&d.mu)
	if a.FailBodies != nil {
		d.failBodies = map[string]bool{}
		for _, b := range a.FailBodies {
			d.failBodies[b] = true
		}
	}
	return d
}

// record notes a listener call's messages (from mq); whether the call is to be answered with a failure: one of
// its bodies is to fail and has been delivered at most failTimes times.
func (d *deliveries) record(msgs []*primitive.MessageExt, mq primitive.MessageQueue) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	fail := false
	entries := []result{}
	for _, m := range msgs {
		body := label(m.Body)
		d.perBody[body]++
		n := d.perBody[body]
		fail = fail || (n <= d.failTimes && (d.failBodies == nil || d.failBodies[body]))
		entries = append(entries, result{
			"body":           body,
			"bodyLength":     len(m.Body),
			"msgId":          m.MsgId,
			"offsetMsgId":    m.OffsetMsgId,
			"topic":          m.Topic,
			"tags":           m.GetTags(),
			"keys":           m.GetKeys(),
			"queueTopic":     mq.Topic, // %RETRY%<group> for a message that came back
			"broker":         mq.BrokerName,
			"queueId":        mq.QueueId,
			"queueOffset":    m.QueueOffset,
			"reconsumeTimes": m.ReconsumeTimes,
			"properties":     m.GetProperties(),
			"delivery":       n,
			"atMs":           millis(time.Now()),
		})
	}
	answer := "CONSUME_SUCCESS"
	if fail && d.orderly {
		answer = "SUSPEND_CURRENT_QUEUE_A_MOMENT"
	} else if fail {
		answer = "RECONSUME_LATER"
	}
	for _, e := range entries {
		e["result"] = answer
		d.received = append(d.received, e)
	}
	d.changed.Broadcast()
	return fail
}

// await waits until expect distinct bodies and expectDeliveries deliveries were received (true) or the deadline
// (false); both 0: the deadline.
func (d *deliveries) await(expect, expectDeliveries int, deadline time.Time) bool {
	// A ticker wakes the wait at least every 200 ms, so the deadline is seen without a delivery.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				d.changed.Broadcast()
			}
		}
	}()
	d.mu.Lock()
	defer d.mu.Unlock()
	for {
		if (expect > 0 || expectDeliveries > 0) && len(d.perBody) >= expect && len(d.received) >= expectDeliveries {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		d.changed.Wait()
	}
}

// report is what was received, for the result.
func (d *deliveries) report() result {
	d.mu.Lock()
	defer d.mu.Unlock()
	return result{
		"received":       append([]result{}, d.received...),
		"deliveries":     len(d.received),
		"distinctBodies": len(d.perBody),
	}
}
